"""Per-run scheduling report: a role timeline PNG and a utilisation table.

Both are built from the executor's timeline (the same events that went to the ``cells``
dataset) and written to the run directory and as Prefect artifacts. The PNG is drawn
without a plotting library (PNG is a zlib stream of RGB rows): one band per cell, time
left to right, coloured by role; darker orange where the cell was inside an optimizer step;
a black tick where the scheduler decided a role change.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

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


def png(timeline, n_cells: int, end: float, width: int = 900, band: int = 28) -> bytes:
    """The role timeline as PNG bytes (cells top to bottom, time left to right)."""
    roles, steps, marks = intervals(timeline, n_cells, end)
    gap = 4
    height = n_cells * (band + gap) + gap
    px = [[(255, 255, 255)] * width for _ in range(height)]
    scale = width / max(end, 1e-9)

    def fill(y0: int, y1: int, t0: float, t1: float, rgb) -> None:
        x0, x1 = int(t0 * scale), max(int(t0 * scale) + 1, int(t1 * scale))
        for y in range(y0, y1):
            row = px[y]
            for x in range(max(0, x0), min(width, x1)):
                row[x] = rgb

    for i in range(n_cells):
        y0 = gap + i * (band + gap)
        for t0, t1, role in roles[i]:
            fill(y0, y0 + band, t0, t1, COLOURS.get(role, (255, 0, 255)))
        for t0, t1 in steps[i]:
            fill(y0 + band // 4, y0 + band - band // 4, t0, t1, COLOURS["step"])
        for t in marks[i]:
            fill(y0, y0 + band, t, t + 1 / scale, (0, 0, 0))
    raw = b"".join(b"\x00" + bytes(c for rgb in row for c in rgb) for row in px)

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


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
    directory) and create them as Prefect artifacts."""
    cell_ids = [ex.cell_id(i) for i in range(len(ex.addrs))]
    end = max([e["t"] for e in ex.timeline] + [seconds])
    rows = utilisation(ex.timeline, cell_ids, end)
    md = table_markdown(rows, ex.stats, seconds)
    rel = f"runs/{run_id}"
    store.write_bytes(f"{rel}/roles.png", png(ex.timeline, len(cell_ids), end))
    store.write_bytes(f"{rel}/utilisation.md", f"# {run_id} ({mode})\n\n{md}\n".encode())
    out = store.full_url(rel)
    summary = (
        f"{ex.stats.switches} switches, {ex.stats.sessions_rerouted} sessions rerouted, "
        f"{ex.stats.kv_moved} KV moves"
    )
    try:
        from prefect.artifacts import create_image_artifact, create_markdown_artifact

        create_markdown_artifact(
            key="cell-utilisation",
            markdown=f"## cells of {run_id} ({mode})\n\n{md}\n\nTimeline: `{out}/roles.png`",
            description=f"gyre {run_id}: roles and utilisation",
        )
        if store.protocol == "file":
            create_image_artifact(
                image_url=Path(store.path(rel, "roles.png")).resolve().as_uri(),
                key="role-timeline",
                description=f"gyre {run_id}: cells x time, coloured by role. {LEGEND}",
            )
    except Exception as exc:  # an artifact is a convenience; the files are the record
        summary += f" (artifact not created: {exc})"
    return {"summary": summary, "rows": rows, "dir": out, "markdown": md}
