"""Where processing goes (``infra.cells.executor.steady_cells``, behind
``Executor.process_addrs``), on hand-made states of the three modes: no cluster.

Roles are the executor's own (a cell on its way is ``draining`` or ``loading``); ``busy``
cells have a weight load decided or under way; ``moves`` counts each cell's role changes."""

from __future__ import annotations

from infra.cells.executor import steady_cells

R, T, D, L = "rollout", "train", "draining", "loading"


def test_elastic_processing_stays_on_the_core_while_other_cells_move():
    roles = [R, R, D, T, L, R]  # cells 0, 1: core (never moved); 5 came back from training
    moves = [0, 0, 1, 1, 2, 2]
    assert steady_cells(roles, set(), set(), moves) == (0, 1)
    assert steady_cells(roles, {0}, set(), moves) == (1,)  # cell 0 loads new weights
    assert steady_cells(roles, {0, 1}, set(), moves) == (5,)  # the core loads: a steady one
    assert steady_cells(roles, {0, 1, 5}, set(), moves) == (0, 1)  # all load: still the core
    assert steady_cells(roles, set(), {0}, moves) == (1,)  # a lost cell is none


def test_async_processing_stays_on_the_rollout_side_even_while_it_loads():
    roles = [R, R, R, T, T]
    moves = [0] * 5
    assert steady_cells(roles, set(), set(), moves) == (0, 1, 2)
    # after a step every rollout cell loads: the train cells (stepping) are still never one
    assert steady_cells(roles, {0, 1, 2}, set(), moves) == (0, 1, 2)


def test_colocate_processing_goes_to_any_rollout_cell_and_none_while_all_train():
    moves = [4, 4, 4]  # every cell moved at every step
    assert steady_cells([R, R, R], set(), set(), moves) == (0, 1, 2)
    assert steady_cells([D, D, R], set(), set(), moves) == (2,)
    assert steady_cells([T, T, T], set(), set(), moves) == ()  # anywhere (never happens:
    # colocate's step starts once every group is processed)
