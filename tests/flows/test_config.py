import copy
import pickle
from pathlib import Path

import pytest

from flows.config import PRESETS, ConfigError, RunConfig, load_config


def test_defaults_and_presets():
    assert load_config() == RunConfig()
    tiny = load_config(preset="tiny")
    assert tiny.train.steps == PRESETS["tiny"]["train"]["steps"]
    demo = load_config(preset="demo")
    assert demo.rollout.suite == "tools" and demo.warmstart.enabled and demo.eval.every > 0
    assert load_config(preset="repo").rollout.suite == "repo"


def test_file_then_store_then_overrides(tmp_path: Path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  steps: 5\n  lr: 0.01\nstore: /from/file\n")
    cfg = load_config(
        config_file=f,
        preset="tiny",
        store="/from/flag",
        overrides=["train.steps=7", "rollout.temperature=0.5"],
    )
    assert (cfg.train.steps, cfg.train.lr, cfg.store) == (7, 0.01, "/from/flag")
    assert cfg.rollout.temperature == 0.5


def test_every_error_reported_at_once_with_key_value_and_fix():
    with pytest.raises(ConfigError) as ei:
        load_config(overrides=["train.stepz=3", "rollout.group_size=0", "train.loss=sgd", "oops"])
    msg = str(ei.value)
    assert len(ei.value.problems) == 4  # unknown keys and bad values, together
    assert "train.stepz=3" in msg and "did you mean 'train.steps'" in msg
    assert "'oops'" in msg and "key=value" in msg
    assert "rollout.group_size=0" in msg and "train.loss='sgd'" in msg
    with pytest.raises(ConfigError) as ei:
        load_config(overrides=["rollout.group_size=0", "train.loss=sgd"])
    msg = str(ei.value)
    assert "rollout.group_size=0" in msg and "greater than or equal to 1" in msg
    assert "train.loss='sgd'" in msg and "ppo_clip" in msg


def test_unknown_preset_and_unreadable_file(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(preset="huge", config_file=tmp_path / "missing.yaml")
    assert len(ei.value.problems) == 2
    assert "unknown preset" in str(ei.value) and "cannot read" in str(ei.value)


def test_model_path_must_be_a_checkpoint(tmp_path):
    from flows.preflight import check_model_dir, preflight
    from infra.engine.tiny_model import make_tiny_model

    store = f"store={tmp_path / 'store'}"
    with pytest.raises(ConfigError, match=r"model\.path='/nope/nothing': no such directory"):
        preflight(load_config(overrides=["model.path=/nope/nothing", store]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"not a checkpoint: it lacks config.json, weights"):
        preflight(load_config(overrides=[f"model.path={tmp_path / 'empty'}", store]))
    assert check_model_dir(make_tiny_model()) is None


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception):  # noqa: B017  (pydantic's frozen error type)
        cfg.train.steps = 9  # type: ignore[misc]


def test_kv_budget_checked_against_max_new_tokens():
    with pytest.raises(ConfigError, match=r"model\.kv_cache_tokens=2048: too small"):
        load_config(overrides=["model.kv_cache_tokens=2048", "rollout.max_new_tokens=4096"])


@pytest.mark.parametrize(
    "override, setting",
    [
        ("train.steps=true", "train.steps"),  # a bool is not a step count
        ("train.steps=1e12", "train.steps"),  # a float is not a step count
        ("rollout.group_size='4'", "rollout.group_size"),  # a quoted string is not a size
        ("cluster.memory_limit=6", "cluster.memory_limit"),  # a size is a string like 6GiB
    ],
)
def test_values_are_strictly_typed(override, setting):
    with pytest.raises(ConfigError) as err:
        load_config(preset="tiny", overrides=[override])
    assert any(p.startswith(setting + "=") for p in err.value.problems), err.value.problems


def test_exponent_floats_and_ints_are_read_as_numbers():
    cfg = load_config(overrides=["train.lr=1e-3", "rollout.temperature=1", "train.steps=3"])
    assert cfg.train.lr == 1e-3 and cfg.rollout.temperature == 1.0 and cfg.train.steps == 3


def test_load_config_never_changes_the_presets():
    before = copy.deepcopy(PRESETS)
    load_config(preset="demo", overrides=["train.steps=1", "rollout.group_size=2"])
    with pytest.raises(ConfigError):
        load_config(preset="demo", overrides=["train.nope=1"])
    assert before == PRESETS
    assert load_config(preset="demo").train.steps == PRESETS["demo"]["train"]["steps"]


def test_sections_reach_tasks_as_their_own_typed_models():
    from tasks.env.config import RolloutConfig
    from tasks.train.config import TrainConfig

    cfg = load_config(preset="tiny", overrides=["train.advantage=per_subtask"])
    assert isinstance(cfg.train, TrainConfig) and isinstance(cfg.rollout, RolloutConfig)
    assert cfg.train.advantage == "per_subtask"  # the name a task reads is the name a user sets
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # travels to Dask workers as is


def test_every_setting_says_what_it_means():
    """`gyre config --list` can explain every key: each field of the schema has help text."""
    from flows.config import _known_keys, settings

    rows = settings()
    assert [r["key"] for r in rows] == _known_keys(RunConfig)
    missing = [r["key"] for r in rows if not r["description"].strip()]
    assert not missing, f"settings without a description: {missing}"


def test_gyre_config_list_shows_every_setting_with_the_presets_values(capsys):
    from flows.cli import main
    from flows.config import _known_keys, settings

    assert main(["config", "--list", "--preset", "demo", "train.lr=0.01"]) == 0
    out = capsys.readouterr().out
    keys = [line.split("=", 1)[0] for line in out.splitlines() if not line.startswith(" ")]
    assert keys == _known_keys(RunConfig)
    lines = out.splitlines()
    steps = lines.index("train.steps=50")  # the preset's value, then its meaning and default
    assert lines[steps + 1] == "    # optimizer steps of the run (default 2)"
    assert "train.lr=0.01" in lines and "rollout.suite=tools" in lines
    assert all(r["description"].split()[0] in out for r in settings())
    # without --list: only what differs from the defaults
    assert main(["config", "--preset", "demo"]) == 0
    short = capsys.readouterr().out
    assert "train.steps=50" in short and "cluster.memory_limit" not in short
    # settings left at None resolve from others (train.temperature from the rollouts'): a
    # default run lists nothing; a changed rollout temperature lists both it and the trainer's
    assert main(["config"]) == 0
    assert capsys.readouterr().out.startswith("every setting at its default")
    assert main(["config", "rollout.temperature=0.7"]) == 0
    changed = [ln.split("=")[0] for ln in capsys.readouterr().out.splitlines() if "=" in ln[:40]]
    assert {"rollout.temperature", "train.temperature"} <= set(changed), changed


def test_a_cmd_harness_override_is_a_string_not_a_mapping():
    cfg = load_config(overrides=["rollout.harness=cmd: python agent.py --x 1"])
    assert cfg.rollout.harness == "cmd: python agent.py --x 1"
    assert load_config(overrides=["rollout.harness=cmd:python a.py"]).rollout.harness == (
        "cmd:python a.py"
    )
