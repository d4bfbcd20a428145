"""More bad inputs (issue 26), each tried as a user would (the `gyre` command) and each
refused before anything starts: exit 2, the problem named with its fix, no traceback."""

from __future__ import annotations

import json
import time

import pytest

from storage.checkpoints import publish_checkpoint, stage_checkpoint
from storage.commits import commit_step_record
from storage.store import Store
from tests.flows.test_bad_input import _gyre, _refused

pytestmark = pytest.mark.integration

# 9 levels of 9: 9**9 (387M) strings from a few hundred bytes ("billion laughs")
BOMB = "a: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n" + "".join(
    f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_alias_bomb_is_refused_at_once(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    assert len(BOMB) < 400
    t0 = time.monotonic()
    res = _gyre("run", "--config", str(bomb), "--store", str(tmp_path / "s"), timeout=60)
    _refused(res, "--config", "aliases")
    assert time.monotonic() - t0 < 10  # about a second of it is the interpreter's start
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("path", ["/dev/zero", "DIR"])
def test_non_regular_config_is_refused(tmp_path, path):
    path = str(tmp_path) if path == "DIR" else path
    res = _gyre("run", "--config", path, "--store", str(tmp_path / "s"), timeout=60)
    _refused(res, f"--config {path}", "not a regular file")


def test_oversized_config_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    res = _gyre("run", "--config", str(big), "--store", str(tmp_path / "s"))
    _refused(res, "larger than")


def test_duplicate_yaml_key_is_refused_naming_key_and_line(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("train:\n  steps: 3\n  lr: 0.001\n  steps: 4\n")
    res = _gyre("run", "--config", str(f), "--store", str(tmp_path / "s"))
    _refused(res, "'steps' appears twice", "line 2", "line 4")


@pytest.mark.parametrize("raw", ["'1e-3'", '"1e-3"', "'0.001'"])
def test_quoted_number_is_a_string_and_refused(tmp_path, raw):
    res = _gyre("run", "--preset", "tiny", f"train.lr={raw}", "--store", str(tmp_path / "s"))
    _refused(res, "train.lr=", "valid number")


def test_quoted_number_in_yaml_is_refused(tmp_path):
    f = tmp_path / "q.yaml"
    f.write_text("train:\n  lr: '1e-3'\n")
    res = _gyre("run", "--config", str(f), "--store", str(tmp_path / "s"))
    _refused(res, "train.lr=", "valid number")


def test_resume_with_preset_is_refused(tmp_path):
    res = _gyre("run", "--resume", "r1", "--preset", "tiny", "--store", str(tmp_path / "s"))
    _refused(res, "--preset with --resume", "key=value")


def _finished_run(store_dir, run_id: str, steps: int, tmp_path) -> None:
    """A store in which ``run_id`` has committed ``steps`` steps (no run needed)."""
    store = Store(str(store_dir))
    src = tmp_path / "ck"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w")
    publish_checkpoint(store, run_id, str(src), 0)
    for step in range(steps):
        stage_checkpoint(store, run_id, str(src), step + 1)
        ledger = [{"run_id": run_id, "step": step, "sample_id": f"s{step}",
                   "weight_version": step, "t": 0.0}]  # fmt: skip
        row = {"run_id": run_id, "step": step, "weight_version": step, "n_samples": 1}
        commit_step_record(store, run_id, step, step + 1, ledger, row)
    cfg = {"run_id": run_id, "train": {"steps": steps}}
    store.write_bytes(f"runs/{run_id}/config.json", json.dumps(cfg).encode())


@pytest.mark.parametrize("how", ["fresh", "resume"])
def test_nothing_to_train_is_said_before_anything_starts(tmp_path, how):
    sdir = tmp_path / "s"
    _finished_run(sdir, "done1", 2, tmp_path)
    t0 = time.monotonic()
    if how == "fresh":
        res = _gyre("run", "--preset", "tiny", "run_id=done1", "train.steps=2",
                    "--store", str(sdir), timeout=60)  # fmt: skip
    else:
        res = _gyre("run", "--resume", "done1", "train.steps=1", "--store", str(sdir), timeout=60)
    _refused(res, "already has 2 steps", "nothing to train")
    assert "starting Prefect" not in res.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_serve_port_out_of_range_is_a_usage_error(tmp_path, port):
    res = _gyre("serve", "--port", port, "--store", str(tmp_path / "s"))
    _refused(res, "--port", "not a port number (1-65535)")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("out", ["DIR", "/proc/x/run.parquet", "MISSING/run.parquet"])
def test_export_out_that_cannot_be_written_is_refused(tmp_path, out):
    store = Store(str(tmp_path / "s"))
    publish_checkpoint(store, "r", str(_model_dir(tmp_path)), 0)
    out = {"DIR": str(tmp_path), "MISSING/run.parquet": str(tmp_path / "no" / "run.parquet")}.get(
        out, out
    )
    res = _gyre("export", "r", "--store", store.url, "--out", out)
    _refused(res, "--out")


def _model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    return d
