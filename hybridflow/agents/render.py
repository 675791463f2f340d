"""Chat-template pieces for token-in-token-out multi-turn rollouts.

The conversation's earlier turns are never decoded and re-tokenized: only the *new* messages
are rendered, as the text the chat template writes for them after an assistant turn:

    delta = template(base + new, add_generation_prompt=True)[len(template(base)):]

with ``base`` a fixed user + assistant exchange (verl's agent loop and SkyRL do the same), and
tokenized on their own. ``end_of_turn_ids`` are the tokens the template writes after an
assistant message's content (ChatML: ``<|im_end|>\\n``).
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, Any]]
_BASE: Messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
_PROBE = "hybridflow-probe-7b1c"


class ChatRenderer:
    """Renders observations and turn ends for ``tokenizer`` (which must have a chat template).

    tool_role: "tool" when the template renders a tool message's content, else "user" (tool
    results are then sent as user messages).
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.tool_role = "tool" if self._renders({"role": "tool", "name": "t", "content": _PROBE}) else "user"
        text = self._text([{"role": "user", "content": "U"}, {"role": "assistant", "content": _PROBE}])
        self.end_of_turn_ids = self._ids(text[text.rindex(_PROBE) + len(_PROBE) :])
        self.supports_tools = "tools" in tokenizer.chat_template

    def _text(self, messages: Messages, **kw: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kw)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _renders(self, message: dict[str, Any]) -> bool:
        try:
            return _PROBE in self._text([*_BASE, message])
        except Exception:  # noqa: BLE001 - templates raise on roles they do not know
            return False

    def observation_ids(self, messages: Messages) -> list[int]:
        """Token ids of ``messages`` after an assistant turn, ending with the generation prompt of
        the next assistant turn. Tool messages use the user role when the template lacks a tool role."""
        fixed = [m if m.get("role") != "tool" or self.tool_role == "tool" else
                 {"role": "user", "content": m.get("content", "")} for m in messages]  # fmt: skip
        base = self._text(_BASE)
        full = self._text([*_BASE, *fixed], add_generation_prompt=True)
        if not full.startswith(base):
            raise ValueError("the chat template renders earlier turns differently once messages follow")
        return self._ids(full[len(base) :])

    def prompt_ids(self, messages: Messages, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation start (with the generation prompt), as the dataset renders prompts."""
        kw = {"tools": tools} if tools else {}
        text = self._text(messages, add_generation_prompt=True, **kw)
        ids = self._ids(text)
        bos = self.tokenizer.bos_token_id
        probe = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        if bos is not None and probe[:1] == [bos] and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids


def fit_observation(
    renderer: ChatRenderer, messages: Messages, limit: int, marker: str
) -> tuple[Messages, list[int], bool]:
    """(messages, their observation ids, whether cut) with the rendering within ``limit`` tokens, so
    that the stored conversation holds what the model saw: when the rendering is longer, each text
    content keeps its head and tail around ``marker`` (an equal share of the room the template leaves,
    decoded back to text) and is rendered again. Where that share is too small for the marker, or
    the second rendering still exceeds ``limit``, the ids are cut in the middle as well
    (:func:`truncate_middle`)."""
    ids = renderer.observation_ids(messages)
    if len(ids) <= limit:
        return messages, ids, False
    tok = renderer.tokenizer
    marker_ids = renderer._ids(marker)
    texts = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]
    empty = [{**m, "content": ""} if i in texts else m for i, m in enumerate(messages)]
    room = (limit - len(renderer.observation_ids(empty))) // max(1, len(texts))
    if room > len(marker_ids):
        messages = list(messages)
        for i in texts:
            content_ids = renderer._ids(messages[i]["content"])
            if len(content_ids) > room:
                kept = truncate_middle(content_ids, room, marker_ids)
                head = (room - len(marker_ids)) // 2
                text = tok.decode(kept[:head]) + marker + tok.decode(kept[head + len(marker_ids) :])
                messages[i] = {**messages[i], "content": text}
        ids = renderer.observation_ids(messages)
    return messages, truncate_middle(ids, limit, marker_ids), True


def truncate_middle(ids: list[int], limit: int, marker_ids: list[int]) -> list[int]:
    """``ids`` if it has ≤ ``limit`` tokens, else its head and tail around ``marker_ids`` (total
    ``limit``; the tail gets the odd token). ``limit`` must exceed ``len(marker_ids)``, else the
    head alone is kept."""
    if len(ids) <= limit:
        return list(ids)
    keep = limit - len(marker_ids)
    if keep <= 0:
        return list(ids[:limit])
    head = keep // 2
    tail = keep - head
    return [*ids[:head], *marker_ids, *ids[len(ids) - tail :]]


def marked_conversation(tokenizer: Any, response_ids: Any, response_mask: Any, observation_mask: Any) -> str:
    """A multi-turn response as text for people (sample tables): model tokens as they are, each run of
    observation tokens as ``[observation: ...]``. Tensors [R] (one row); special tokens dropped."""
    parts, run, kind = [], [], None
    for tok, model, obs in zip(response_ids.tolist(), response_mask.tolist(), observation_mask.tolist(), strict=True):
        here = "model" if model else "obs" if obs else None
        if here != kind and run:
            parts.append((kind, run))
            run = []
        kind = here
        if here is not None:
            run.append(tok)
    if run:
        parts.append((kind, run))
    texts = []
    for k, ids in parts:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        texts.append(f"[observation: {text.strip()}]" if k == "obs" else text)
    return "".join(texts)


__all__ = ["ChatRenderer", "fit_observation", "marked_conversation", "truncate_middle"]
