"""Standard-harness evaluation: local lm-eval tasks from verl rows (:mod:`.lm_eval_tasks`) and running lm-eval
on a loaded model offline (:mod:`.harness`). docs/evaluation.md."""
