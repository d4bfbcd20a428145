"""Where processing goes (``infra.cells.executor.steady_cells``, behind
``Executor.process_addrs``), on hand-made states of the three modes: no cluster.

Roles are the executor's own (a cell on its way is ``draining`` or ``loading``); ``busy``
cells have a weight load decided or under way. Every steady rollout cell is a candidate
(Dask takes the least occupied): keeping processing on elastic's core alone queued every
group's processing on one cell at 8 cells (BENCHMARKS.md, issue 25)."""

from __future__ import annotations

from infra.cells.executor import steady_cells

R, T, D, L = "rollout", "train", "draining", "loading"


def test_elastic_processing_goes_to_every_steady_rollout_cell_never_one_on_its_way():
    roles = [R, R, D, T, L, R]  # cells 0, 1: core; 5 came back from training
    assert steady_cells(roles, set(), set()) == (0, 1, 5)
    assert steady_cells(roles, {0}, set()) == (1, 5)  # cell 0 loads new weights
    assert steady_cells(roles, {0, 1}, set()) == (5,)  # the core loads: a steady one
    assert steady_cells(roles, {0, 1, 5}, set()) == (0, 1, 5)  # all load: still rollout cells
    assert steady_cells(roles, set(), {0}) == (1, 5)  # a lost cell is none
    assert steady_cells(roles, {1, 5}, {0}) == (1, 5)  # the rest all load: the live ones


def test_async_processing_stays_on_the_rollout_side_even_while_it_loads():
    roles = [R, R, R, T, T]
    assert steady_cells(roles, set(), set()) == (0, 1, 2)
    # after a step every rollout cell loads: the train cells (stepping) are still never one
    assert steady_cells(roles, {0, 1, 2}, set()) == (0, 1, 2)


def test_colocate_processing_goes_to_any_rollout_cell_and_none_while_all_train():
    assert steady_cells([R, R, R], set(), set()) == (0, 1, 2)
    assert steady_cells([D, D, R], set(), set()) == (2,)
    assert steady_cells([T, T, T], set(), set()) == ()  # anywhere (never happens:
    # colocate's step starts once every group is processed)
