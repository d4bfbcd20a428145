"""A resumed run rolls out on the newest weights: its lag stays within the bound.

``gyre run --preset tiny run_id=lagtest train.steps=2``, then ``--resume lagtest
train.steps=8``: before the fix the resumed scheduler told cells serving v2 to "load v1",
they kept the weights they resumed from, and 4 of the 6 resumed steps dropped all their
tokens (issue 15). Read from the store as a user would (SQL over ``steps`` and ``ledger``):
every trained token's lag is within ``train.max_staleness``, no trainable token was dropped,
and the versions the rollouts generated with reach the last ones published.

The fast guard of the same bug is tests/infra/cells/test_resumed_versions.py.
"""

from __future__ import annotations

import pytest

from storage.sql import query
from storage.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SETTINGS = ["rollout.group_size=3"]


def test_a_resumed_run_keeps_every_token_within_the_lag_bound(prefect_harness, tmp_path):
    from flows.rl_run import rl_run

    url = str(tmp_path / "store")
    first = rl_run(preset="tiny", store=url, run_id="lagtest", overrides=[*SETTINGS])
    assert first["weight_version"] == 2
    second = rl_run(
        preset="tiny", store=url, run_id="lagtest", resume=True, overrides=["train.steps=8"]
    )
    assert second["weight_version"] == 8
    store = Store(url)
    steps = query(
        store,
        "SELECT step, weight_version, trainable_tokens, dropped_tokens, lag_max "
        "FROM steps WHERE run_id = 'lagtest' ORDER BY step",
    ).to_pylist()
    assert [(s["step"], s["weight_version"]) for s in steps] == [(k, k + 1) for k in range(8)]
    bound = 1  # train.max_staleness, the default
    for s in steps:
        assert s["dropped_tokens"] == 0, s
        assert s["lag_max"] <= bound, s
    worst = query(
        store, "SELECT max(lag_max) AS m, count(*) AS n FROM ledger WHERE run_id = 'lagtest'"
    ).to_pylist()[0]
    assert worst["n"] > 0 and worst["m"] <= bound
    # the resumed rollouts generated with the weights the resumed steps published
    served = query(
        store, "SELECT max(weight_version) AS v FROM tito WHERE run_id = 'lagtest'"
    ).to_pylist()[0]["v"]
    assert served >= 7
    # the final version's held-out evaluation: a cell was asked to load v8 (not v8 + 2)
    evals = query(
        store, "SELECT DISTINCT version FROM evals WHERE run_id = 'lagtest' ORDER BY 1"
    ).to_pylist()
    assert evals[-1]["version"] == 8, evals
