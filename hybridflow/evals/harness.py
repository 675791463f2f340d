"""Running EleutherAI's lm-evaluation-harness (``lm-eval``) on a model in memory, offline.

:func:`check_tasks` resolves task names before anything starts (an unknown name, with the
closest known ones; a task whose dataset would be fetched from the Hugging Face hub).
:func:`run_lm_eval` evaluates an already loaded causal LM and tokenizer through lm-eval's
``HFLM`` (``simple_evaluate``), with the model's chat template applied by default: lm-eval
applies none unless asked, which scores an instruct model on text it was never trained to
continue. Results come back as flat metrics ``eval/<task>/<metric>[_<filter>]`` plus the
per-document samples when ``log_samples``.

lm-eval's version is pinned in the ``eval`` extra (``lm-eval[hf]==0.4.13``); a missing or
different version is :class:`HarnessError` naming the install command.
"""

from __future__ import annotations

import difflib
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

LM_EVAL_VERSION = "0.4.13"
HARNESSES = ("lm-eval",)
# datasets builders that read local files (dataset_kwargs.data_files); anything else is a hub dataset
_LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


class HarnessError(ValueError):
    """A harness that is missing or at another version, an unknown task, a task that needs the network."""


@dataclass(frozen=True)
class HarnessResult:
    """metrics: {"eval/<task>/<metric>": value} (lm-eval's "<metric>,<filter>" keys become
    "<metric>_<filter>" when the filter is not "none"; stderr keys dropped, NaN dropped);
    samples: {task: [{"doc", "target", "response", "filtered": {filter: answer}, "scores": {"<metric>_<filter>": value}}]};
    n_samples: {task: documents evaluated}; versions: {task: task version}."""

    metrics: dict[str, float]
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    n_samples: dict[str, int] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)


def require_lm_eval() -> Any:
    """The ``lm_eval`` module at :data:`LM_EVAL_VERSION`; HarnessError otherwise."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("lm_eval")
    except PackageNotFoundError:
        raise HarnessError(f"the lm-eval harness is not installed: pip install 'lm-eval[hf]=={LM_EVAL_VERSION}' "
                           "(or: pip install -e '.[eval]')") from None
    if found != LM_EVAL_VERSION:
        raise HarnessError(f"lm-eval {found} is installed; hybridflow is tested with {LM_EVAL_VERSION}: "
                           f"pip install 'lm-eval[hf]=={LM_EVAL_VERSION}'")
    import lm_eval

    return lm_eval


@contextmanager
def _offline():
    """The HF hub and datasets offline while lm-eval builds its tasks (no network at run time
    here): a hub dataset fails at once instead of retrying for a minute. huggingface_hub and
    datasets read HF_HUB_OFFLINE when imported, so their module constants are set too."""
    import datasets.config
    import huggingface_hub.constants as hub

    keys = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    old = {k: os.environ.get(k) for k in keys}
    old_consts = (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    os.environ.update(keys)
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = old_consts
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def task_manager(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's TaskManager over ``include_path`` (a folder of task YAMLs) alone when it holds every
    one of ``tasks`` (indexing lm-eval's ~15,000 built-in tasks takes seconds), else over both."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not os.path.isdir(include_path):
            raise HarnessError(f"include_path {include_path!r} is not a folder of lm-eval task YAMLs")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def _dataset_path(entry: Any) -> str | None:
    """The ``dataset_path`` of an indexed task (its YAML with ``include:`` files merged), None for
    a group, a tag or a Python-defined task."""
    if getattr(entry, "yaml_path", None) is None:
        return None
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(entry.yaml_path, resolve_func=False)
    except Exception:  # noqa: BLE001 - an unreadable YAML is reported when the task is built
        return None
    return cfg.get("dataset_path") if isinstance(cfg, dict) and "task" in cfg else None


def _leaf_tasks(loaded: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in loaded.items():
        if isinstance(value, dict):
            out |= _leaf_tasks(value)
        else:
            out[getattr(key, "group_name", None) or str(key)] = value
    return out


def check_tasks(tasks: list[str], include_path: str | None) -> dict[str, int]:
    """Resolve ``tasks`` (task, group or tag names) and build them offline (their documents are
    read). Returns {leaf task: documents in its evaluation split}. Raises HarnessError with one
    line: no tasks; an unknown name (the closest known names); a task whose dataset is on the
    hub (no network at run time: write a local task, ``hybridflow data lm-eval-task``); a task that
    does not build offline (a missing local data file, a group over hub tasks)."""
    if not tasks:
        raise HarnessError("no lm-eval tasks given (--tasks NAME[,NAME...] or trainer.eval.tasks)")
    tm = task_manager(tasks, include_path)
    known = set(tm.all_tasks)
    for name in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            where = f" or in {include_path}" if include_path else " (pass --include-path DIR for local task YAMLs)"
            raise HarnessError(f"unknown lm-eval task {name!r}: not among lm-eval's {len(known)} tasks{where}{hint}")
        path = _dataset_path(tm.task_index.get(name))
        if path is not None and path not in _LOCAL_BUILDERS and not os.path.isdir(path):
            raise HarnessError(f"lm-eval task {name!r} reads dataset {path!r} from the Hugging Face hub: no network "
                               "at run time; write a local task (hybridflow data lm-eval-task) instead")
    import datasets
    from lm_eval.tasks import get_task_dict

    quiet = not datasets.utils.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()  # a check before a run starts prints nothing of its own
    with _offline():
        try:
            loaded = get_task_dict(tasks, tm)
        except Exception as e:  # noqa: BLE001 - lm-eval/datasets raise many types; one line names the tasks
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise HarnessError(f"lm-eval tasks {','.join(tasks)} do not load offline ({type(e).__name__}: "
                               f"{first[:200]}); tasks here must read local files (dataset_path: json + "
                               "dataset_kwargs.data_files, see hybridflow data lm-eval-task)") from None
        finally:
            if quiet:
                datasets.enable_progress_bars()
    return {name: len(task.eval_docs) for name, task in _leaf_tasks(loaded).items()}


def _flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    out = {}
    for task, row in results.get("results", {}).items():
        for key, value in row.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}_{filt}"
            if not math.isnan(float(value)):
                out[f"eval/{task}/{name}"] = float(value)
    return out


def _samples(results: dict[str, Any], limit: int) -> dict[str, list[dict[str, Any]]]:
    """One row per document (lm-eval logs one per filter): doc, target, response, and per filter the
    extracted answer (``filtered``) and the scores (``scores``: "<metric>_<filter>" as in the metrics)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for task, rows in (results.get("samples") or {}).items():
        docs: dict[Any, dict[str, Any]] = {}
        for s in rows:
            row = docs.get(s.get("doc_id"))
            if row is None:
                if len(docs) == limit:
                    continue
                resp = s.get("resps") or [[""]]
                row = docs[s.get("doc_id")] = {"doc": s.get("doc"), "target": s.get("target"),
                                               "response": resp[0][0] if resp and resp[0] else "",
                                               "filtered": {}, "scores": {}}
            filt = s.get("filter", "none")
            row["filtered"][filt] = (s.get("filtered_resps") or [""])[0]
            for m in s.get("metrics", []):
                if m in s:
                    row["scores"][m if filt == "none" else f"{m}_{filt}"] = float(s[m])
        out[task] = list(docs.values())
    return out


def run_lm_eval(
    model: Any,
    tokenizer: Any,
    tasks: list[str],
    *,
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    apply_chat_template: bool = True,
    system_instruction: str | None = None,
    log_samples: bool = True,
    max_samples_kept: int = 1000,
    seed: int = 0,
) -> HarnessResult:
    """Evaluate ``model`` (a transformers causal LM, eval mode is set here) with ``tokenizer`` on
    lm-eval ``tasks`` (the first ``limit`` documents of each, all if None), greedy as each task's
    YAML says, on the model's device. ``apply_chat_template``: render each prompt with the
    tokenizer's chat template (lm-eval's ``--apply_chat_template``). Offline (HF_HUB_OFFLINE).
    Raises HarnessError (see :func:`check_tasks`)."""
    if limit is not None and limit < 1:
        raise HarnessError(f"limit must be >= 1, got {limit}")
    lm_eval = require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    model.eval()
    tm = task_manager(list(tasks), include_path)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device),
              max_length=getattr(model.config, "max_position_embeddings", None))
    with _offline():
        results = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=tm, limit=limit, log_samples=log_samples,
            apply_chat_template=apply_chat_template, system_instruction=system_instruction,
            bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed, verbosity="ERROR")
    if results is None:  # only on non-zero ranks of a distributed lm-eval run, which this is not
        raise HarnessError("lm-eval returned no results")
    return HarnessResult(
        metrics=_flat_metrics(results),
        samples=_samples(results, max_samples_kept) if log_samples else {},
        n_samples={t: int(v.get("effective", v.get("original", 0))) for t, v in results.get("n-samples", {}).items()},
        versions=dict(results.get("versions", {})),
    )
