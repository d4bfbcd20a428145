"""A finished run's artifacts, made by the real code against the Prefect API in
``PREFECT_API_URL``: a parent flow (the run a user opens) whose sub-flow draws the role
timeline and the learning curve and moves the progress bar, as ``rl_run``/``schedule`` do.
Run as ``python -m tests.flows.ui_run STORE RUN_ID`` (tests/flows/test_ui_browser.py)."""

from __future__ import annotations

import sys

from prefect import flow

from flows.evaluation import write_learning
from flows.progress import Progress
from flows.report import write_report
from storage.store import Store
from tests.flows.test_learning import _evals
from tests.flows.test_pictures import _executor


@flow(name="schedule")
def schedule(store_url: str, run_id: str) -> None:
    st = Store(store_url)
    Progress(run_id, 0, 2).update(2, 0.5)
    write_report(_executor(), st, run_id, 10.0, "elastic")
    st.append("steps", [{"run_id": run_id, "step": s, "loss": 1.0 - s / 4, "lag_mean": 0.5}
                        for s in range(3)])  # fmt: skip
    write_learning(st, run_id, {"run_id": run_id})


@flow(name="rl_run")
def rl_run(store_url: str, run_id: str) -> None:
    st = Store(store_url)
    st.append("evals", _evals(run_id, {0: [("a", 0.25), ("b", 0.5)], 3: [("a", 0.75), ("b", 1.0)]}))
    schedule(store_url, run_id)


if __name__ == "__main__":
    rl_run(sys.argv[1], sys.argv[2])
