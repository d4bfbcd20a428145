"""The learning code's tests catch planted bugs: kill rate >= 90% (slow: a few minutes).

    PYTHONPATH=$PWD python -m pytest -m mutation tests/mutation -q

The table of every mutant and what killed it: ``python -m tests.mutation.runner``.
"""

from __future__ import annotations

import pytest

from tests.mutation import runner
from tests.mutation.mutants import MUTANTS


def test_every_mutant_still_applies():
    """Fast: each planted edit still matches the code exactly once (else the list rotted)."""
    for m in MUTANTS:
        runner.check_applies(m)
    assert len(MUTANTS) >= 25
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.mutation
def test_kill_rate_of_the_learning_tests(tmp_path):
    results = runner.run(MUTANTS, keep=tmp_path)
    s = runner.summary(results)
    assert s["kill_rate"] >= 0.9, s
