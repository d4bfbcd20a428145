"""Workload files, the duration stream, and the closed forms the bound uses."""

import dataclasses
import json
import math

import numpy as np
import pytest

from tasks.sched.workload import (
    Durations,
    Workload,
    WorkloadError,
    capped_mean,
    expected_max,
    load_workload,
)

BENCH = "bench/workloads"


def test_every_bench_workload_file_loads():
    import glob

    files = glob.glob(f"{BENCH}/*.yaml")
    assert len(files) >= 9
    names = {load_workload(f).name for f in files}
    assert {"reference", "stationary", "bursty", "train-heavy", "small", "coarse"} <= names


def test_reference_values_are_the_documented_ones():
    w = load_workload(f"{BENCH}/reference.yaml")
    assert (w.cells, w.cap, w.batch, w.steps) == (1000, 4, 4000, 48)
    assert (w.median_s, w.growth, w.sigma, w.timeout_s) == (900.0, 4.0, 1.0, 14400.0)
    # the median grows 4x by the last batch and stays
    assert w.median_at(0) == 900.0
    assert w.median_at(w.total_rollouts) == pytest.approx(3600.0)
    assert w.median_at(10 * w.total_rollouts) == pytest.approx(3600.0)
    assert w.median_at(w.total_rollouts // 2) == pytest.approx(1800.0)  # geometric


def test_base_inheritance_and_overrides(tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\ncells: 16\nbatch: 64\nwhy: text\n")
    (tmp_path / "b.json").write_text(json.dumps({"base": "a", "sigma": 2}))
    w = load_workload(tmp_path / "b.json")
    assert (w.name, w.cells, w.batch, w.sigma) == ("b", 16, 64, 2.0)


def test_every_error_reported_at_once(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("cells: 1\nsigma: -1\nbogus: 3\ncap: two\n")
    with pytest.raises(WorkloadError) as e:
        load_workload(p)
    msg = str(e.value)
    for part in ("unknown key 'bogus'", "cap='two'", "cells=1", "sigma=-1"):
        assert part in msg, msg
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(tmp_path / "missing.yaml")


def test_same_duration_stream_for_every_mode_and_growth_scales_it():
    w = Workload(cells=8, batch=32, steps=4, median_s=100.0, timeout_s=1e9)
    a, b = Durations(w, seed=3), Durations(w, seed=3)
    assert [a[i] for i in range(5000)] == [b[i] for i in range(5000)]
    g = dataclasses.replace(w, growth=4.0)
    c = Durations(g, seed=3)
    # same normal draws, medians scaled by growth ** (i / (steps * batch))
    for i in (0, 64, 127, 500):
        assert c[i] == pytest.approx(a[i] * 4.0 ** min(1.0, i / 128))
    assert Durations(w, seed=4)[0] != a[0]


def test_bursts_come_after_a_calm_start():
    w = Workload(cells=8, batch=10, steps=4, burst_every=4, burst_len=1, burst_factor=3.0)
    meds = [w.median_at(i) for i in range(40)]
    assert meds[:30] == [w.median_s] * 30  # batches 0-2 calm
    assert meds[30:40] == [3 * w.median_s] * 10  # batch 3: the wave
    assert w.frozen_at_start().median_at(35) == w.median_s


def test_regrain_and_resize_keep_the_devices_and_the_batch_per_slot():
    w = Workload(cells=1000, cap=4, batch=4000, train_s_per_sample=60.0)
    c = w.regrain(8)
    assert (c.cells, c.cap, c.train_s_per_sample, c.batch) == (125, 32, 7.5, 4000)
    with pytest.raises(WorkloadError, match="divisor"):
        w.regrain(3)
    r = w.resized(64)
    assert (r.cells, r.batch) == (64, 256)


def test_capped_mean_and_expected_max_against_sampling():
    rng = np.random.default_rng(0)
    med, sigma, cap = 1800.0, 1.0, 14400.0
    d = np.minimum(med * np.exp(sigma * rng.standard_normal((4000, 64))), cap)
    assert capped_mean(med, sigma, cap) == pytest.approx(d.mean(), rel=0.01)
    assert expected_max(med, sigma, cap, 64) == pytest.approx(d.max(axis=1).mean(), rel=0.01)
    assert expected_max(med, sigma, cap, 1) == pytest.approx(capped_mean(med, sigma, cap), rel=1e-3)
    # large batches: the longest rollout is the cap
    assert expected_max(med, sigma, cap, 4000) == pytest.approx(cap, rel=1e-3)
    assert capped_mean(med, 0.0, cap) == med and expected_max(med, 0.0, 10.0, 5) == 10.0
    # closed form of the uncapped mean
    assert capped_mean(med, sigma, 1e12) == pytest.approx(med * math.exp(0.5))


def test_growth_file_training_follows_length():
    w = load_workload(f"{BENCH}/growth.yaml")
    assert w.train_follows_length and w.growth == 12.0
    mean0 = capped_mean(w.median_s, w.sigma, w.timeout_s)
    assert w.start_mean_s == pytest.approx(mean0)
    # a sample of the mean length costs train_s_per_sample; twice as long, twice the cost
    assert w.train_cost(mean0) == pytest.approx(w.train_s_per_sample)
    assert w.train_cost(2 * mean0) == pytest.approx(2 * w.train_s_per_sample)
    # by the end of the run a mean sample costs ~10x (the capped mean grew ~10x)
    end = w.mean_train_cost(w.median_s * w.growth)
    assert 9 * w.train_s_per_sample < end < 11 * w.train_s_per_sample
    # off (the default): every sample costs the same whatever its length
    off = dataclasses.replace(w, train_follows_length=False)
    assert off.train_cost(10 * mean0) == off.train_s_per_sample
