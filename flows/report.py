"""Per-run scheduling report: a role timeline PNG and a utilisation table.

Both are built from the executor's timeline (the same events that went to the ``cells``
dataset) and written to the run directory and as one Prefect artifact (the PNG embedded).
The PNG (matplotlib, Agg): one band per cell named on the y axis, seconds on the x axis,
coloured by role; darker orange where the cell was inside an optimizer step; a black tick
where the scheduler decided a role change; a legend and a title.
"""

from __future__ import annotations

from typing import Any

from flows.progress import artifact_key, figure_png, image_markdown, run_artifact

COLOURS = {
    "rollout": (66, 133, 244),  # blue
    "train": (251, 188, 5),  # amber
    "step": (214, 110, 0),  # dark orange: inside an optimizer step
    "draining": (160, 160, 160),
    "loading": (110, 110, 110),
    "idle": (255, 255, 255),
}
LEGEND = (
    "blue = rollout, amber = train (idle), dark orange = in an optimizer step, "
    "light grey = draining, dark grey = loading, black tick = a role change decided"
)


def intervals(timeline: list[dict[str, Any]], n_cells: int, end: float):
    """Per cell: [(t0, t1, role)] role intervals and [(t0, t1)] step intervals, and the
    decision times of role changes."""
    roles: list[list[tuple[float, float, str]]] = [[] for _ in range(n_cells)]
    steps: list[list[tuple[float, float]]] = [[] for _ in range(n_cells)]
    marks: list[list[float]] = [[] for _ in range(n_cells)]
    cur: list[tuple[float, str] | None] = [None] * n_cells
    step_open: list[float | None] = [None] * n_cells
    for ev in sorted(timeline, key=lambda e: e["t"]):
        i, t, kind, role = ev["cell"], ev["t"], ev["event"], ev["role"]
        if kind in ("join", "role", "decide", "leave"):
            if kind == "decide" and role not in ("draining", "loading"):
                continue  # a weight load decided: no role change
            if kind == "decide":
                marks[i].append(t)
            if cur[i] is not None:
                roles[i].append((cur[i][0], t, cur[i][1]))
            cur[i] = None if kind == "leave" else (t, role)
        elif kind == "step":
            step_open[i] = t
        elif kind == "step_done" and step_open[i] is not None:
            steps[i].append((step_open[i], t))
            step_open[i] = None
    for i in range(n_cells):
        if cur[i] is not None:
            roles[i].append((cur[i][0], end, cur[i][1]))
        if step_open[i] is not None:
            steps[i].append((step_open[i], end))
    return roles, steps, marks


def utilisation(timeline, cell_ids: list[str], end: float) -> list[dict[str, Any]]:
    """Per cell: seconds and fractions in each role, in steps, and the switches decided."""
    roles, steps, marks = intervals(timeline, len(cell_ids), end)
    rows = []
    for i, cid in enumerate(cell_ids):
        tot: dict[str, float] = {}
        for t0, t1, role in roles[i]:
            tot[role] = tot.get(role, 0.0) + (t1 - t0)
        busy = sum(t1 - t0 for t0, t1 in steps[i])
        span = max(end, 1e-9)
        rows.append(
            {
                "cell": cid,
                "rollout": tot.get("rollout", 0.0) / span,
                "train": tot.get("train", 0.0) / span,
                "switching": (tot.get("draining", 0.0) + tot.get("loading", 0.0)) / span,
                "in_steps": busy / span,
                "switches": len(marks[i]),
            }
        )
    return rows


def roles_figure(timeline, cell_ids: list[str], end: float, title: str = ""):
    """The role timeline as a matplotlib figure: one band per cell (named on the y axis),
    seconds since the loop started on the x axis, coloured by role, the optimizer steps as
    a dark inner bar, a black tick per role change decided; a legend and a title."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = len(cell_ids)
    roles, steps, marks = intervals(timeline, n, end)
    fig = Figure(figsize=(9.0, 1.6 + 0.45 * n), dpi=100)
    ax = fig.add_subplot()
    rgb = {k: tuple(c / 255 for c in v) for k, v in COLOURS.items()}
    seen: set[str] = set()
    for i in range(n):
        y = n - 1 - i  # the first cell on top
        for t0, t1, role in roles[i]:
            ax.broken_barh([(t0, max(t1 - t0, 1e-9))], (y - 0.4, 0.8),
                           facecolors=rgb.get(role, (1, 0, 1)), edgecolors="none")  # fmt: skip
            seen.add(role)
        if steps[i]:
            ax.broken_barh([(t0, t1 - t0) for t0, t1 in steps[i]], (y - 0.2, 0.4),
                           facecolors=rgb["step"], edgecolors="none")  # fmt: skip
            seen.add("step")
        if marks[i]:
            ax.vlines(marks[i], y - 0.45, y + 0.45, colors="black", linewidth=1.2)
    ax.set_yticks(range(n), list(reversed(cell_ids)))
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, max(end, 1e-9))
    ax.set_xlabel("seconds since the loop started")
    ax.set_ylabel("cell")
    ax.grid(axis="x", alpha=0.3)
    labels = {
        "rollout": "rollout (serving)",
        "train": "train (idle)",
        "step": "in an optimizer step",
        "draining": "draining",
        "loading": "loading weights",
    }
    handles: list = [
        Patch(facecolor=rgb[k], edgecolor="grey", label=v) for k, v in labels.items() if k in seen
    ]
    if any(marks):
        handles.append(Line2D([], [], color="black", label="role change decided"))
    if not handles:  # an empty timeline still says what the colours would mean
        handles = [Patch(facecolor=rgb[k], label=v) for k, v in labels.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.3 / max(n, 1)),
              ncol=min(len(handles), 6), fontsize=8, frameon=False)  # fmt: skip
    ax.set_title(title or "cells over time, by role", fontsize=10)
    fig.tight_layout()
    return fig


def png(timeline, cell_ids: list[str], end: float, title: str = "") -> bytes:
    """The role timeline (``roles_figure``) as PNG bytes."""
    return figure_png(roles_figure(timeline, cell_ids, end, title))


def table_markdown(rows: list[dict[str, Any]], stats: Any, seconds: float) -> str:
    lines = [
        "| cell | rollout | train | switching | in steps | switches |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['cell']} | {r['rollout']:.0%} | {r['train']:.0%} | {r['switching']:.0%} "
            f"| {r['in_steps']:.0%} | {r['switches']} |"
        )
    lat = sorted(stats.switch_latency_s)
    med = lat[len(lat) // 2] if lat else 0.0
    lines += [
        "",
        f"{seconds:.1f}s, {stats.steps} steps, {stats.groups_done} groups finished; "
        f"{stats.switches} role switches (median decision -> serving {med:.2f}s), "
        f"{stats.sessions_rerouted} sessions rerouted, {stats.kv_moved} KV moves "
        f"({stats.kv_tokens} tokens), {stats.reprefills} re-prefills, "
        f"{stats.weight_loads} weight loads.",
        "",
        LEGEND,
    ]
    return "\n".join(lines)


def write_report(ex, store, run_id: str, seconds: float, mode: str) -> dict:
    """Write ``runs/{run_id}/roles.png`` and ``utilisation.md`` into the store (the run's
    directory) and create them as Prefect artifacts of the run (keys per run); the PNG is
    embedded in the markdown (a data URI) so that the UI shows it wherever the store is."""
    cell_ids = [ex.cell_id(i) for i in range(len(ex.addrs))]
    end = max([e["t"] for e in ex.timeline] + [seconds])
    rows = utilisation(ex.timeline, cell_ids, end)
    md = table_markdown(rows, ex.stats, seconds)
    rel = f"runs/{run_id}"
    picture = png(ex.timeline, cell_ids, end, f"{run_id} ({mode}): cells over time, by role")
    store.write_bytes(f"{rel}/roles.png", picture)
    store.write_bytes(f"{rel}/utilisation.md", f"# {run_id} ({mode})\n\n{md}\n".encode())
    out = store.full_url(rel)
    summary = (
        f"{ex.stats.switches} switches, {ex.stats.sessions_rerouted} sessions rerouted, "
        f"{ex.stats.kv_moved} KV moves"
    )
    markdown = (
        f"## cells of {run_id} ({mode})\n\n{image_markdown(picture, 'role timeline')}\n\n"
        f"{md}\n\nFiles: `{out}/roles.png`, `{out}/utilisation.md`"
    )
    problem = run_artifact(
        artifact_key("gyre-cells", run_id), markdown, f"gyre {run_id}: roles and utilisation"
    )
    if problem:  # an artifact is a convenience; the files are the record
        summary += f" (artifact not created: {problem})"
    return {"summary": summary, "rows": rows, "dir": out, "markdown": md}
