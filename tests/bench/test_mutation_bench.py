"""bench/mutation.py's pure parts: mutmut's exit codes folded into the per-module table and
the JSON figures, and the seam map (the bench itself, which runs mutmut, is never run here:
``make mutation``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import mutation  # noqa: E402

# issue 26's seam modules, at least
ISSUE = {
    "storage/lease.py",
    "storage/checkpoints.py",
    "storage/transcripts.py",
    "tasks/sched/costs.py",
    "tasks/sched/bound.py",
    "infra/cells/executor.py",
    "infra/cells/healing.py",
    "infra/cells/zygote.py",
    "flows/served.py",
    "tasks/train/dp.py",
    "tasks/train_step.py",
    "infra/gateway/chat.py",
    "infra/gateway/tool_prompt.py",
}


def test_every_seam_module_exists_and_has_fast_tests():
    assert set(mutation.SEAMS) >= ISSUE
    for path in mutation.SEAMS:
        assert (ROOT / path).is_file(), path
        assert mutation.tests_for(path), f"{path}: none of its test files exists"


def test_classify_counts_each_column_and_the_fraction():
    codes = {
        "m.a__mutmut_1": 1,  # killed
        "m.a__mutmut_2": 0,  # survived
        "m.a__mutmut_3": 36,  # timeout (counts as killed)
        "m.a__mutmut_4": 33,  # no test reaches it (counts as a survivor)
        "m.a__mutmut_5": 0,  # survived, triaged equivalent (left out)
        "m.a__mutmut_6": None,  # not run (left out)
        "m.a__mutmut_7": -24,  # SIGXCPU: timeout
        "m.a__mutmut_8": 1,  # not in the sample
    }
    sample = [f"m.a__mutmut_{i}" for i in range(1, 8)]
    row = mutation.classify("storage/x.py", codes, sample, {"m.a__mutmut_5": "same value"})
    c = row.counts
    assert (row.total, row.sampled) == (8, 7)
    assert (c["killed"], c["survived"], c["timeout"], c["no_tests"]) == (1, 1, 2, 1)
    assert (c["equivalent"], c["not_run"]) == (1, 1)
    assert row.fraction == 3 / 5  # (killed + timeout) / (sampled - equivalent - not run)


def test_an_equivalent_name_does_not_hide_a_kill():
    row = mutation.classify("storage/x.py", {"k": 1}, ["k"], {"k": "said equivalent"})
    assert row.counts["killed"] == 1 and row.counts["equivalent"] == 0


def test_table_and_json_name_every_module():
    a = mutation.classify("storage/lease.py", {"a": 1, "b": 0}, ["a", "b"], {})
    b = mutation.classify("tasks/sched/bound.py", {"c": 1}, ["c"], {})
    text = mutation.table([a, b])
    assert "| storage/lease.py | 2/2 | 1 | 1 | 0 | 0 | 0 | 0 | 50% |" in text
    assert "| tasks/sched/bound.py | 1/1 | 1 | 0 |" in text
    out = mutation.to_json([a, b], 12.0)
    assert out["mutation_killed_fraction_min"] == 0.5
    assert out["mutation_storage_lease_killed"] == 1
    assert out["mutation_storage_lease_survived"] == 1
    assert out["mutation_tasks_sched_bound_timeout"] == 0
    assert out["mutation_tasks_sched_bound_equivalent"] == 0
    assert out["mutation_tasks_sched_bound_fraction"] == 1.0


def test_the_config_mutates_only_the_module_and_runs_fast_tests():
    text = mutation._config("storage/lease.py", ["tests/storage/test_lease.py"])
    assert 'only_mutate = ["storage/lease.py"]' in text
    assert '"not slow and not gpu"' in text
    assert 'pytest_add_cli_args_test_selection = ["tests/storage/test_lease.py"]' in text


def test_the_sweep_removes_only_what_mutants_wrote(tmp_path):
    (tmp_path / "storage").mkdir()
    (tmp_path / "README.md").write_text("x")
    clean = {"storage", "README.md"}
    (tmp_path / "COMPLETE").write_text("1")  # a mutated path wrote it here
    (tmp_path / "ckpts_store").mkdir()
    (tmp_path / "ckpts_store" / "f").write_text("1")
    assert mutation._sweep(tmp_path, clean) == ["COMPLETE", "ckpts_store"]
    assert sorted(os.listdir(tmp_path)) == ["README.md", "storage"]
    assert mutation._sweep(tmp_path, clean) == []


def test_the_sweep_keeps_mutmuts_own_files(tmp_path):
    (tmp_path / "mutmut-stats.json").write_text("{}")  # written by mutmut after the copy
    assert mutation._sweep(tmp_path, set()) == []
    assert os.listdir(tmp_path) == ["mutmut-stats.json"]
