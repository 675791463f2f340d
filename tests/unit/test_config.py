import subprocess
import sys

import pytest
from pydantic import ValidationError

from hybridflow.config import ConfigError, flatten_config, load_config, parse_overrides


def test_defaults_validate():
    cfg = load_config()
    assert cfg.trajectories_per_iteration == cfg.data.prompts_per_iteration * cfg.rollout.samples_per_prompt
    assert cfg.needs_critic is False


def test_overrides_parse_types():
    d = parse_overrides(["actor.lr=2e-6", "data.train_files=[a.parquet, b.jsonl]", "actor.use_kl_loss=true"])
    assert d == {"actor": {"lr": 2e-6, "use_kl_loss": True}, "data": {"train_files": ["a.parquet", "b.jsonl"]}}


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(ValidationError):
        cfg.actor.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("actor.lr=-1", "actor.lr=-1"),
        ("algorithm.adv_estimator=grpoo", "allowed: "),
        ("rollout.engine=tgi", "'hf' or 'vllm'"),
        ("actor.lrr=1", "unknown key 'actor.lrr'"),
        ("actor.mini_batch_trajectories=5", "must divide"),
        ("actor.lm_head=fused", "actor.lm_head"),
    ],
)
def test_bad_values_name_key_and_allowed(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert fragment in str(e.value)
    assert "Traceback" not in str(e.value)


def test_critic_required_for_gae():
    with pytest.raises(ConfigError, match="needs a critic"):
        load_config(None, ["algorithm.adv_estimator=gae", "placement.pools.main.roles=[policy]"])


def test_overlong_buffer_longer_than_the_responses_is_a_config_error():
    # caught when the config loads, not inside the advantage node after the pools started
    ov = ["algorithm.overlong_buffer.enable=true", "rollout.max_response_tokens=8"]
    with pytest.raises(ConfigError, match=r"overlong_buffer.buffer_tokens=24 must be <= rollout.max_response_tokens=8"):
        load_config(None, [*ov, "algorithm.overlong_buffer.buffer_tokens=24"])
    assert load_config(None, [*ov, "algorithm.overlong_buffer.buffer_tokens=8"]).algorithm.overlong_buffer.enable
    # disabled: the buffer length is not used, so it is not checked
    load_config(None, ["rollout.max_response_tokens=8", "algorithm.overlong_buffer.buffer_tokens=24"])


def test_double_kl_needs_explicit_allow():
    ov = ["algorithm.use_kl_in_reward=true", "actor.use_kl_loss=true"]
    with pytest.raises(ConfigError, match="both on"):
        load_config(None, ov)
    assert load_config(None, ov + ["algorithm.allow_kl_in_reward_and_loss=true"]).needs_reference


def test_flatten_has_dotted_keys():
    flat = flatten_config(load_config())
    assert flat["actor.lr"] == 1e-6
    assert flat["placement.pools.main.workers"] == 1


def test_cli_config_show_and_errors():
    cmd = [sys.executable, "-m", "flows.cli", "config", "show", "actor.lr=3e-6"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "lr: 3.0e-06" in out.stdout
    bad = subprocess.run(cmd[:-1] + ["algorithm.adv_estimator=grpoo"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "algorithm.adv_estimator" in lines[0] and "grpo" in lines[0]


def test_cli_config_show_reports_tools_that_do_not_load(capsys):
    from flows.cli import main

    assert main(["config", "show", "rollout.tools=[nope]"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: rollout.tools[0]='nope': unknown tool"), captured.err
    assert captured.out == ""  # nothing printed for a config that cannot run
    assert main(["config", "show", "rollout.environment=no-such-env"]) == 2
    assert "rollout.environment='no-such-env': unknown environment" in capsys.readouterr().err


def test_critic_batch_sizes_checked_only_with_a_critic():
    ov = ["data.prompts_per_iteration=2", "rollout.samples_per_prompt=2", "actor.mini_batch_trajectories=4",
          "actor.micro_batch_trajectories=2"]
    assert load_config(None, ov).critic.mini_batch_trajectories == 16  # GRPO: no critic, not checked
    with pytest.raises(ConfigError, match="critic.mini_batch_trajectories=16"):
        load_config(None, ov + ["algorithm.adv_estimator=gae"])


def test_prompts_per_step_is_a_deprecated_alias_of_prompts_per_iteration(tmp_path, caplog):
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  prompts_per_step: 3\nrollout:\n  samples_per_prompt: 2\nactor:\n  mini_batch_trajectories: 6\n  micro_batch_trajectories: 2\n")
    with pytest.warns(FutureWarning, match="config key data.prompts_per_step is deprecated and will be removed in "
                      r"hybridflow 0\.3\.0; use data.prompts_per_iteration"):
        cfg = load_config(old)
    assert "use data.prompts_per_iteration" in caplog.text  # logged too: in the run's log, not only on stderr
    with pytest.warns(FutureWarning, match="DataConfig.prompts_per_step is deprecated .*use DataConfig.prompts_per_iteration"):
        assert cfg.data.prompts_per_iteration == 3 and cfg.data.prompts_per_step == 3
    assert cfg.trajectories_per_iteration == 6 == cfg.trajectories_per_step
    assert "prompts_per_step" not in cfg.model_dump()["data"]  # what a run saves uses the new name
    with pytest.warns(FutureWarning, match="data.prompts_per_step is deprecated"):
        assert load_config(old, ["data.prompts_per_step=6"]).data.prompts_per_iteration == 6  # an old override too
    with pytest.raises(ConfigError, match="data.prompts_per_step and data.prompts_per_iteration are both set"):
        load_config(old, ["data.prompts_per_iteration=3"])


def test_rollout_correction_config():
    cfg = load_config(None, ["actor.rollout_correction=tis"])
    assert cfg.actor.tis_threshold == 2.0 and cfg.actor.behav_weight_cap is None
    # the correction needs the recomputed old_log_probs: "auto" stops taking the hf engine's own
    assert load_config().old_log_probs_from_rollout and not cfg.old_log_probs_from_rollout
    decoupled = load_config(None, ["actor.rollout_correction=decoupled", "actor.behav_weight_cap=5"])
    assert decoupled.actor.behav_weight_cap == 5.0 and not decoupled.old_log_probs_from_rollout
    assert not load_config(None, ["actor.rollout_correction=tis", "actor.old_log_probs=recompute"]).old_log_probs_from_rollout


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["actor.rollout_correction=tis", "actor.old_log_probs=rollout"],
         "actor.rollout_correction=tis needs recomputed old_log_probs but actor.old_log_probs=rollout"),
        (["actor.rollout_correction=decoupled", "actor.old_log_probs=rollout"], "actor.rollout_correction=decoupled"),
        (["actor.behav_weight_cap=2"], "actor.behav_weight_cap is set but actor.rollout_correction=none"),
        (["actor.rollout_correction=tis", "actor.behav_weight_cap=2"], "rollout_correction=decoupled only"),
        (["actor.rollout_correction=decoupled", "actor.behav_weight_cap=0"], "actor.behav_weight_cap"),
        (["actor.tis_threshold=0"], "actor.tis_threshold"),
        (["actor.rollout_correction=is"], "actor.rollout_correction"),
    ],
)
def test_rollout_correction_config_errors(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert fragment in str(e.value) and "Traceback" not in str(e.value)


def test_malformed_yaml_is_one_line_naming_file_line_and_column(tmp_path, capsys):
    """Issue 40, defect 13: PyYAML's 8-line caret context becomes one line, FILE:LINE:COLUMN."""
    from flows.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  lr: 1e-6\n  clip: [0.2\nrollout:\n  temperature: 1.0\n")
    assert main(["config", "show", "-c", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"config error: {bad}:4:8: not valid YAML: "), err[0]
