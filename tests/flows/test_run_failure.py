"""How `gyre run` explains the end of a run whose cause a user can act on (flows/cli.py)."""

from flows.cli import _run_failure
from infra.cells.reach import StoreUnreachable


def _raised_inside(cause: BaseException) -> BaseException:
    """``cause`` as a flow would surface it: wrapped by whatever ran it."""
    try:
        try:
            raise cause
        except BaseException as e:
            raise RuntimeError("Flow run encountered an exception") from e
    except RuntimeError as outer:
        return outer


def test_a_store_no_cell_host_can_reach_is_named_with_the_host():
    why = "cell 1 on host 10.0.0.3: StoreError: no such bucket"
    line = _run_failure(_raised_inside(StoreUnreachable(why)), "gyre run --resume r1")
    assert line is not None and why in line and "gyre run --resume r1" in line


def test_an_unknown_failure_is_left_to_the_traceback():
    assert _run_failure(_raised_inside(ValueError("bug")), "gyre run --resume r1") is None
