"""Standard-harness evaluation (lm-eval, issue 39): local tasks written from verl rows, the answer
extraction they declare run through lm-eval's own filter and metric, the offline task checks, a real
``simple_evaluate`` on a tiny model compared with a plain greedy ``generate``, and the config."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from hybridflow.config import ConfigError, load_config
from hybridflow.data.tasks import make_arith
from hybridflow.evals.harness import HarnessError, check_tasks, run_lm_eval
from hybridflow.evals.lm_eval_tasks import ANSWER_FORMATS, FLEXIBLE_NUMBER, write_local_task


def _rg_row(question: str, answer: str) -> dict:
    from hybridflow.data.tasks.reasoning_gym import INSTRUCTION

    return {"data_source": "reasoning_gym/chain_sum", "prompt": [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}],
            "reward_model": {"ground_truth": answer}}


def test_a_local_task_holds_the_rows_and_extracts_the_format_the_prompt_asks_for(tmp_path):
    rows = make_arith(5, difficulty=0, seed=3)
    task = write_local_task(rows, "arith_t", tmp_path, max_gen_toks=32)
    assert (task.rows, task.answer_format) == (5, "boxed")
    cfg = yaml.safe_load(task.yaml_path.read_text())
    assert cfg["task"] == "arith_t" and cfg["dataset_path"] == "json"
    assert cfg["dataset_kwargs"]["data_files"]["test"] == str(task.docs_path.resolve())
    assert cfg["generation_kwargs"]["max_gen_toks"] == 32 and cfg["generation_kwargs"]["until"] == []
    docs = [json.loads(line) for line in task.docs_path.read_text().splitlines()]
    assert [d["question"] for d in docs] == [r["prompt"][-1]["content"] for r in rows]
    assert [d["answer"] for d in docs] == [r["reward_model"]["ground_truth"] for r in rows]
    assert [f["name"] for f in cfg["filter_list"]] == ["boxed", "flexible"]  # numeric answers: both
    rg = write_local_task([_rg_row("What is 2 + 3?", "5")], "rg_t", tmp_path)
    assert rg.answer_format == "answer_tag"
    words = write_local_task([_rg_row("Spell cat backwards.", "tac")], "rg_w", tmp_path)
    assert [f["name"] for f in yaml.safe_load(words.yaml_path.read_text())["filter_list"]] == ["answer_tag"]


@pytest.mark.parametrize(("fmt", "response", "want"), [
    ("boxed", "3 + 4 = 7, so \\boxed{7}", "7"),
    ("boxed", "first \\boxed{6}, no: \\boxed{7}", "7"),  # the last answer counts
    ("boxed", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # one level of nested braces
    ("boxed", "the answer is 7", "[no answer]"),
    ("answer_tag", "thinking... <answer> 42 </answer>", "42"),
    ("answer_tag", "<answer>1</answer> then <answer>2</answer>", "2"),
    ("flexible", "19 - 8 = 11", "11"),  # the last number, without \boxed
    ("flexible", "so x is -5.", "-5."),  # the final period is ignored by the metric (below)
    ("flexible", "it costs $1,200", "$1,200"),
    ("flexible", "no digits", "[no answer]"),
])
def test_lm_eval_s_own_regex_filter_extracts_the_answer(fmt, response, want):
    from lm_eval.filters.extraction import RegexFilter

    pattern = FLEXIBLE_NUMBER if fmt == "flexible" else ANSWER_FORMATS[fmt][1]
    f = RegexFilter(regex_pattern=pattern, group_select=-1, fallback="[no answer]")
    assert list(f.apply([[response]], [{}]))[0] == [want]


def test_exact_match_ignores_case_commas_dollars_and_a_final_period_not_value(tmp_path):
    from lm_eval.api.metrics import exact_match_hf_evaluate

    task = write_local_task(make_arith(1, difficulty=0, seed=3), "arith_t", tmp_path)
    metric = yaml.safe_load(task.yaml_path.read_text())["metric_list"][0]
    kwargs = {k: metric[k] for k in ("ignore_case", "ignore_punctuation", "regexes_to_ignore")}
    got = exact_match_hf_evaluate(predictions=["7", "Yes", "7.0", "-5.", "$1,200"],
                                  references=["7", "yes", "7", "-5", "1200"], **kwargs)
    assert got["exact_match"] == pytest.approx(4 / 5)  # 7.0 ≠ 7: string match, as docs/evaluation.md says


@pytest.mark.parametrize(("rows", "msg"), [
    ([], "no rows"),
    ([{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q \\boxed{}"}],
       "reward_model": {"ground_truth": "1"}}], "single-turn user prompts"),
    ([{"prompt": [{"role": "user", "content": "q \\boxed{}"}], "reward_model": {}}], "ground_truth"),
    ([{"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reward_model": {"ground_truth": "2"}}],
     "no answer format"),
    ([{"prompt": [{"role": "user", "content": "a \\boxed{}"}], "reward_model": {"ground_truth": "2"}},
      {"prompt": [{"role": "user", "content": "b <answer>"}], "reward_model": {"ground_truth": "2"}}], "mix"),
])
def test_rows_a_local_task_cannot_hold_are_refused(tmp_path, rows, msg):
    with pytest.raises(ValueError, match=msg):
        write_local_task(rows, "bad", tmp_path)
    with pytest.raises(ValueError, match="task name"):
        write_local_task(make_arith(1, difficulty=0, seed=0), "bad name", tmp_path)


def test_check_tasks_counts_local_documents_and_refuses_unknown_and_hub_tasks(tmp_path):
    write_local_task(make_arith(7, difficulty=0, seed=3), "arith_t", tmp_path)
    assert check_tasks(["arith_t"], str(tmp_path)) == {"arith_t": 7}
    with pytest.raises(HarnessError, match=r"unknown lm-eval task 'arith_x'.*did you mean arith_t"):
        check_tasks(["arith_x"], str(tmp_path))
    # gsm8k is one of lm-eval's own tasks; its dataset lives on the hub
    with pytest.raises(HarnessError, match=r"'gsm8k' reads dataset 'openai/gsm8k' from the Hugging Face hub"):
        check_tasks(["gsm8k"], str(tmp_path))
    with pytest.raises(HarnessError, match="not a folder"):
        check_tasks(["arith_t"], str(tmp_path / "missing"))
    with pytest.raises(HarnessError, match="no lm-eval tasks"):
        check_tasks([], None)


def test_a_local_task_whose_documents_are_gone_fails_to_load_in_one_line(tmp_path):
    task = write_local_task(make_arith(3, difficulty=0, seed=3), "arith_t", tmp_path)
    task.docs_path.unlink()
    with pytest.raises(HarnessError, match="do not load offline") as e:
        check_tasks(["arith_t"], str(tmp_path))
    assert "\n" not in str(e.value)


def test_lm_eval_generates_what_greedy_generate_does_with_the_chat_template(tmp_path):
    """The harness's responses on a tiny random model are exactly transformers' greedy continuation
    of the chat-templated prompt: the chat template is applied, and nothing else is added."""
    from hybridflow.models import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), hidden_size=16, layers=1, seed=0)
    rows = make_arith(3, difficulty=0, seed=5)
    write_local_task(rows, "arith_t", tmp_path, max_gen_toks=12)
    result = run_lm_eval(model, tok, ["arith_t"], include_path=str(tmp_path), batch_size=2)
    assert result.n_samples == {"arith_t": 3}
    assert set(result.metrics) == {"eval/arith_t/exact_match_boxed", "eval/arith_t/exact_match_flexible"}
    for row, sample in zip(rows, result.samples["arith_t"], strict=True):
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        want = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        assert sample["response"] == want
        assert sample["doc"]["question"] == row["prompt"][-1]["content"]
        assert set(sample["filtered"]) == {"boxed", "flexible"}
    for name in ("exact_match_boxed", "exact_match_flexible"):  # the metric is the mean of the documents' scores
        scores = [s["scores"][name] for s in result.samples["arith_t"]]
        assert result.metrics[f"eval/arith_t/{name}"] == pytest.approx(sum(scores) / len(scores))
    plain = run_lm_eval(model, tok, ["arith_t"], include_path=str(tmp_path), batch_size=2, limit=1,
                        apply_chat_template=False)
    assert plain.n_samples == {"arith_t": 1}
    assert plain.samples["arith_t"][0]["response"] != result.samples["arith_t"][0]["response"]  # another prompt


def test_trainer_eval_config_is_checked():
    cfg = load_config(None, ["trainer.eval.tasks=[arith_t]", "trainer.eval.every=10", "trainer.save_every=5"])
    assert cfg.trainer.eval.enabled and cfg.trainer.eval.apply_chat_template
    assert not load_config(None, []).trainer.eval.enabled
    with pytest.raises(ConfigError, match="multiple of save_every"):
        load_config(None, ["trainer.eval.tasks=[arith_t]", "trainer.eval.every=3", "trainer.save_every=5"])
    with pytest.raises(ConfigError, match="no trainer.eval.tasks"):
        load_config(None, ["trainer.eval.every=5"])
    with pytest.raises(ConfigError, match="role 'evaluator' shares no process"):
        load_config(None, ["placement.pools.main.roles=[policy,evaluator]"])


def test_the_schedule_evaluates_every_nth_checkpoint_and_the_final_one():
    from flows.harness_schedule import HarnessSchedule

    cfg = load_config(None, ["trainer.eval.tasks=[arith_t]", "trainer.eval.every=4", "trainer.save_every=2"])
    s = HarnessSchedule(cfg, "/tmp/run", None)
    assert [it for it in range(1, 11) if s.due(it, final=it == 10)] == [4, 8, 10]
    only_final = HarnessSchedule(load_config(None, ["trainer.eval.tasks=[arith_t]"]), "/tmp/run", None)
    assert [it for it in range(1, 6) if only_final.due(it, final=it == 5)] == [5]
    off = HarnessSchedule(load_config(None, []), "/tmp/run", None)
    assert not any(off.due(it, final=True) for it in range(1, 4))
