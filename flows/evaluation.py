"""Held-out evaluation in a run: when it happens, which cell serves it, what the run reports.

The scheduling flow calls ``HeldOut.poll`` once per tick and ``HeldOut.finish`` after its
last step. Versions ``0, every, 2*every, ..., steps`` (relative to the run's start) are
evaluated (tasks/env/heldout.py): as soon as the policy has published a due version and a
rollout cell serves exactly it, that cell is pinned (``Executor.pin``: a role change or
weight load decided for it waits until the evaluation ends, so every evaluation call runs on
that one version) and ``tasks/evaluate.py`` runs the held-out sessions through the gateway on
it, greedily, next to the training rollouts. The last version is never served during the
loop (the run stops at it): ``finish`` loads it on a rollout cell (or brings a cell back to
rollout, in colocate) through the executor's door and evaluates it.

After the run, ``learning_summary`` reads the ``evals`` view back: ``reward_before`` (the
first version evaluated), ``reward_after`` (the last), their standard errors over the
held-out tasks, the curve, and per task the reward before and after (for ``repo``: the
hidden-test pass fraction); ``write_learning`` draws the curve (matplotlib, Agg: held-out and training reward,
loss and policy lag per step) into ``runs/<run_id>/learning.png`` and writes
``summary.json`` beside it, and one Prefect artifact with the picture embedded.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import dask

from flows.progress import artifact_key, figure_png, image_markdown, run_artifact
from storage.sql import query
from storage.store import Store
from tasks.env.heldout import eval_seeds, eval_versions, mean_and_se
from tasks.evaluate import EvalDone, evaluate_policy
from tasks.rollout import admin_token_variable
from tasks.sched.coordinator import LoadWeights, Move

log = logging.getLogger(__name__)


class HeldOut:
    """Schedules the run's held-out evaluations around the executor (see the module doc)."""

    def __init__(
        self,
        run_id: str,
        cfg: Any,
        store: Store,
        gateway: Any,
        start_version: int,
        first_step: int = 0,
        steps: int | None = None,
    ):
        """``start_version``/``first_step``: where this invocation starts (a resumed run
        starts past 0); ``steps``: how many it trains (default ``cfg.train.steps``)."""
        self.run_id, self.cfg, self.store, self.gateway = run_id, cfg, store, gateway
        self.start, self.first_step = start_version, first_step
        n = cfg.train.steps if steps is None else steps
        done = _evaluated(store, run_id) if self.first_step else set()  # a resumed run
        self.due = [
            start_version + v
            for v in eval_versions(n, cfg.eval.every)
            if start_version + v not in done
        ]
        self.seeds = eval_seeds(cfg.eval)
        self.job: Any = None
        self.pinned: int | None = None
        self.done: list[EvalDone] = []

    @property
    def enabled(self) -> bool:
        return bool(self.due)

    def poll(self, ex: Any) -> None:
        """Collect a finished evaluation; start the next one when its version is served."""
        if not self.due and self.job is None:
            return
        if self.job is not None:
            if not self.job.wrapped_future.done():
                return
            self._collect(ex)
        if not self.due or ex.version < self.due[0]:
            return
        for i in sorted(ex.routed):  # the core cell (elastic never moves it) first
            v = ex.pin(i)
            if v is None:
                continue
            if v < self.due[0]:
                ex.unpin(i)
                continue
            # v is the due version, or newer when no cell ever served the due one
            self.due = [d for d in self.due if d > v]
            self._start(ex, i, v)
            return

    def _start(self, ex: Any, i: int, version: int) -> None:
        self.pinned = i
        with dask.annotate(resources={"harness": 1}):
            self.job = evaluate_policy.submit(
                self.gateway.url,
                admin_token_variable(self.run_id),  # the token itself never is a parameter
                self.store,
                self.run_id,
                version,
                self.first_step + version - self.start,
                ex.cell_id(i),
                self.seeds,
                self.cfg.rollout,
                self.cfg.eval,
                self.cfg.train.reward_aggregation,
            )
        log.info("held-out evaluation of v%d on %s started", version, ex.cell_id(i))

    def _collect(self, ex: Any) -> None:
        job, self.job = self.job, None
        try:
            res: EvalDone = job.result()
        finally:
            ex.unpin(self.pinned)
            self.pinned = None
        for sid in res.session_ids:
            self.gateway.end_session(sid)
        self.done.append(res)
        log.info("held-out v%d: reward %.3f over %d tasks", res.version, res.reward_mean, res.n)

    def finish(self, ex: Any, timeout_s: float = 1800.0) -> None:
        """After the last step: wait for a running evaluation, then evaluate the final
        version on a rollout cell that serves it (loaded or brought back for it)."""
        deadline = time.monotonic() + timeout_s
        if self.job is not None:
            self.job.result(timeout=max(1.0, deadline - time.monotonic()))
            self._collect(ex)
        final = ex.version
        if not self.due or self.due[-1] > final:
            return
        asked = False
        while time.monotonic() < deadline:
            for i in sorted(ex.routed):
                v = ex.pin(i)
                if v == final:
                    self.due = []
                    self._start(ex, i, final)
                    self.job.result(timeout=max(1.0, deadline - time.monotonic()))
                    self._collect(ex)
                    return
                if v is not None:
                    ex.unpin(i)
            if not asked:
                serving = sorted(ex.routed)
                why = "held-out evaluation of the final version"
                if serving:  # a decision counts versions as the coordinator does
                    ex.apply(LoadWeights(serving[0], ex.coord_version(final)), why)
                else:  # colocate ends with every cell training: bring one back to serve
                    ex.apply(Move(0, "rollout"), why)
                asked = True
            time.sleep(0.2)  # the action runs on the executor's pool; its state is polled
        raise TimeoutError(
            f"no rollout cell served the final v{final} within {timeout_s:.0f}s for its "
            "held-out evaluation"
        )


# -- what the run reports ------------------------------------------------------------------


def _evaluated(store: Store, run_id: str) -> set[int]:
    """Versions of ``run_id`` already in ``evals`` (a resumed run does not repeat them)."""
    rid = run_id.replace("'", "''")
    try:
        rows = query(store, f"SELECT DISTINCT version FROM evals WHERE run_id = '{rid}'")
    except Exception as exc:  # no evals yet, or unreadable: evaluate again
        log.warning("could not read the run's earlier evaluations: %s", exc)
        return set()
    return {r["version"] for r in rows.to_pylist()}


def _rows(store: Store, run_id: str) -> list[dict[str, Any]]:
    rid = run_id.replace("'", "''")
    return query(
        store,
        "SELECT version, step, seed, task_id, reward, subtask_ids, subtask_scores "
        f"FROM evals WHERE run_id = '{rid}' ORDER BY version, seed",
    ).to_pylist()


def learning_summary(store: Store, run_id: str) -> dict[str, Any]:
    """``reward_before``/``reward_after`` (held-out, greedy), their standard errors, the
    curve and per-task before/after, from the ``evals`` view; {} when nothing was evaluated."""
    rows = _rows(store, run_id)
    if not rows:
        return {}
    by_v: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_v.setdefault(r["version"], []).append(r)
    curve = []
    for v, rs in sorted(by_v.items()):
        m, se = mean_and_se([r["reward"] for r in rs])
        curve.append({"version": v, "step": rs[0]["step"], "reward": m, "se": se, "n": len(rs)})
    first, last = min(by_v), max(by_v)

    def per_task(v: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for r in by_v[v]:
            out.setdefault(r["task_id"], []).append(r["reward"])
        return out

    before, after = per_task(first), per_task(last)
    tasks = {
        t: {
            "before": sum(before[t]) / len(before[t]),
            "after": sum(after.get(t, [0.0])) / max(1, len(after.get(t, []))),
            "n": len(before[t]),
        }
        for t in sorted(before)
    }
    return {
        "reward_before": curve[0]["reward"],
        "reward_after": curve[-1]["reward"],
        "reward_gain": curve[-1]["reward"] - curve[0]["reward"],
        "reward_before_se": curve[0]["se"],
        "reward_after_se": curve[-1]["se"],
        "eval_tasks": curve[0]["n"],
        "curve": curve,
        "per_task": tasks,
    }


def learning_figure(
    curve: list[dict[str, Any]],
    train: list[dict[str, Any]],
    title: str,
    steps: list[dict[str, Any]] | None = None,
):
    """The learning curve as a matplotlib figure, against optimizer steps. Top: held-out
    reward (greedy, mean +- one standard error over the held-out tasks) and the training
    rollouts' mean reward (sampled). Bottom (when ``steps`` rows are given): the training
    loss, and the policy lag of the trained tokens on a second axis. Every axis labelled,
    every panel with a legend."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = 2 if steps else 1
    fig = Figure(figsize=(6.4, 3.8 if panels == 1 else 6.0), dpi=100)
    ax = fig.add_subplot(panels, 1, 1)
    xs = [c["step"] for c in curve]
    ys = [c["reward"] for c in curve]
    se = [c["se"] for c in curve]
    ax.fill_between(
        xs, [y - s for y, s in zip(ys, se, strict=True)], [y + s for y, s in zip(ys, se, strict=True)],
        alpha=0.2, color="tab:blue", linewidth=0,
    )  # fmt: skip
    ax.plot(xs, ys, "o-", color="tab:blue", label="held-out (greedy), mean ± s.e.")
    if train:
        ax.plot(
            [t["step"] for t in train],
            [t["reward"] for t in train],
            ".-",
            color="tab:orange",
            alpha=0.7,
            label="training rollouts (sampled), mean",
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=9)
    if steps:
        lo = fig.add_subplot(panels, 1, 2, sharex=ax)
        sx = [r["step"] for r in steps]
        (a,) = lo.plot(sx, [r["loss"] for r in steps], ".-", color="tab:red", label="loss")
        lo.set_xlabel("optimizer steps")
        lo.set_ylabel("training loss")
        lo.grid(alpha=0.3)
        lag = lo.twinx()
        (b,) = lag.plot(sx, [r["lag_mean"] or 0.0 for r in steps], ".--", color="tab:green",
                        label="policy lag of trained tokens, mean")  # fmt: skip
        lag.set_ylabel("policy lag (versions)")
        lag.set_ylim(bottom=0)
        lo.legend(handles=[a, b], loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def curve_png(
    curve: list[dict[str, Any]],
    train: list[dict[str, Any]],
    title: str,
    steps: list[dict[str, Any]] | None = None,
) -> bytes:
    """``learning_figure`` as PNG bytes."""
    return figure_png(learning_figure(curve, train, title, steps))


def _curve_markdown(s: dict[str, Any]) -> str:
    lines = [
        "| step | version | held-out reward | s.e. | tasks |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {c['step']} | {c['version']} | {c['reward']:.3f} | {c['se']:.3f} | {c['n']} |"
        for c in s["curve"]
    ]
    lines += [
        "",
        f"reward_before {s['reward_before']:.3f} ± {s['reward_before_se']:.3f}, "
        f"reward_after {s['reward_after']:.3f} ± {s['reward_after_se']:.3f} "
        f"(gain {s['reward_gain']:+.3f})",
    ]
    if len(s["per_task"]) <= 40:
        lines += ["", "| task | before | after | seeds |", "| --- | ---: | ---: | ---: |"]
        lines += [
            f"| {t} | {p['before']:.3f} | {p['after']:.3f} | {p['n']} |"
            for t, p in s["per_task"].items()
        ]
    return "\n".join(lines)


def write_learning(store: Store, run_id: str, summary: dict[str, Any]) -> dict[str, Any]:
    """Add the held-out figures to ``summary``, draw the curve, write ``summary.json`` (in
    ``runs/<run_id>/``) and the Prefect artifacts; returns the completed summary."""
    learned = learning_summary(store, run_id)
    out = {**summary}
    rel = f"runs/{run_id}"
    if learned:
        rid = run_id.replace("'", "''")
        train = query(
            store,
            f"SELECT step, avg(reward) AS reward FROM rollouts WHERE run_id = '{rid}' "
            "GROUP BY 1 ORDER BY 1",
        ).to_pylist()
        steps = query(
            store,
            f"SELECT step, loss, lag_mean FROM steps WHERE run_id = '{rid}' ORDER BY step",
        ).to_pylist()
        title = (
            f"{run_id}: held-out {learned['reward_before']:.2f} -> {learned['reward_after']:.2f}"
        )
        picture = curve_png(learned["curve"], train, title, steps)
        store.write_bytes(f"{rel}/learning.png", picture)
        out.update(
            {k: learned[k] for k in ("reward_before", "reward_after", "reward_gain", "eval_tasks")}
        )
        out["curve"] = " ".join(f"{c['step']}:{c['reward']:.3f}" for c in learned["curve"])
    full = {**out, **({"learning": learned} if learned else {})}
    store.write_bytes(f"{rel}/summary.json", json.dumps(full, indent=2, default=str).encode())
    from prefect.context import FlowRunContext

    if learned and FlowRunContext.get() is not None:  # artifacts belong to a flow run
        run_artifact(
            artifact_key("gyre-learning", run_id),
            f"## held-out reward of {run_id}\n\n{image_markdown(picture, 'learning curve')}"
            f"\n\n{_curve_markdown(learned)}\n\nFiles: `{store.full_url(rel)}/learning.png`, "
            f"`{store.full_url(rel)}/summary.json`",
            f"gyre {run_id}: held-out evaluation",
        )
    return out
