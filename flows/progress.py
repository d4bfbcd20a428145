"""What a run shows in the Prefect UI besides its logs: artifacts with rounded figures.

- a progress artifact, "step k of N, reward r, f sessions failed", updated after every
  optimizer step;
- the resolved settings of the run (markdown, YAML);
- the summary table, with the query that shows the run's steps;
- pictures (role timeline, learning curve) as markdown with the PNG embedded as a
  ``data:`` URI: a browser refuses ``file://`` images from the UI's page, and the store
  may be a bucket the browser cannot read.

Every artifact belongs to the run a user opens (the root flow run: ``rl_run``, or the
deployment's run), not to the sub-flow that made it, and its key names the run, so that
runs never share a timeline. Keys may hold lowercase letters, digits and dashes only; every
function here is best effort (a UI that cannot be reached must not fail a run that trains).
"""

from __future__ import annotations

import base64
import decimal
import io
import logging
import math
import re
from typing import Any

import yaml

log = logging.getLogger(__name__)


def artifact_key(prefix: str, run_id: str) -> str:
    """``prefix-<run id as lowercase letters, digits and dashes>``."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")


def plain(v: Any) -> Any:
    """A number as a user reads it: DuckDB's DECIMAL sums of integers as ``int`` (230096,
    not 230096.0), other decimals as ``float``; anything else unchanged."""
    if isinstance(v, decimal.Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    return v


def rounded(v: Any, digits: int = 4) -> Any:
    """Floats to ``digits`` significant digits; integers (and integral floats of ``digits``
    or more digits, counts), strings and None unchanged."""
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) >= 10**digits:
        return int(v)  # a count that went through a float: every digit counts
    if isinstance(v, float) and math.isfinite(v) and v != 0:
        return float(f"{v:.{digits}g}")
    return v


def figure_png(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes (Agg, cropped to what is drawn, legends included)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def image_markdown(png: bytes, alt: str) -> str:
    """Markdown that shows ``png`` wherever it is rendered: the image as a data URI."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"


def root_flow_run_id() -> Any:
    """The id of the run a user opens: the outermost flow run above the current one (None
    outside a flow run)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None
    run = ctx.flow_run
    if run.parent_task_run_id is None:
        return run.id
    with get_client(sync_client=True) as client:
        while run.parent_task_run_id is not None:
            parent = client.read_task_run(run.parent_task_run_id)
            if parent.flow_run_id is None:
                break
            run = client.read_flow_run(parent.flow_run_id)
    return run.id


def run_artifact(key: str, markdown: str, description: str) -> str | None:
    """A markdown artifact on the root flow run (``root_flow_run_id``); None when made,
    else why not (best effort: never raises)."""
    try:
        from prefect.artifacts import MarkdownArtifact
        from prefect.context import FlowRunContext

        if FlowRunContext.get() is None:
            return "not in a flow run"  # e.g. a report drawn by a test or a script
        MarkdownArtifact(
            key=key, markdown=markdown, description=description, flow_run_id=root_flow_run_id()
        ).create(_sync=True)
    except Exception as exc:
        log.warning("artifact %s not created: %s", key, exc)
        return str(exc)
    return None


def summary_markdown(summary: dict[str, Any], store_url: str, run_id: str) -> str:
    rows = ["| metric | value |", "| --- | --- |"]
    rows += [f"| {k} | {rounded(v)} |" for k, v in summary.items()]
    rid = run_id.replace("'", "''")
    rows += [
        "",
        "Query it: "
        f"`gyre sql --store {store_url} \"SELECT * FROM steps WHERE run_id = '{rid}' ORDER BY step\"`",
    ]
    return "\n".join(rows)


def config_markdown(cfg_dict: dict[str, Any]) -> str:
    text = yaml.safe_dump(cfg_dict, sort_keys=False, default_flow_style=False)
    return f"Resolved settings (what `gyre run --resume` continues with):\n\n```yaml\n{text}```"


class Progress:
    """One progress artifact per run, on its root flow run: ``step k of N, reward r, f
    sessions failed``."""

    def __init__(self, run_id: str, first_step: int, steps: int):
        self.first, self.steps = first_step, max(1, steps)
        self.id = None
        try:
            from prefect.artifacts import ProgressArtifact

            self.id = (
                ProgressArtifact(
                    progress=0.0,
                    key=artifact_key("gyre-progress", run_id),
                    description=f"{run_id}: step {first_step} of {first_step + steps}, starting",
                    flow_run_id=root_flow_run_id(),  # on the run a user opens
                )
                .create(_sync=True)
                .id
            )
        except Exception as exc:
            log.warning("no progress artifact: %s", exc)
        self.run_id = run_id

    def update(self, done: int, reward: float | None, failed: int = 0) -> None:
        """``done`` steps of this invocation finished; ``reward``: the last step's mean;
        ``failed``: sessions whose harness failed so far (tasks/rollout.py)."""
        if self.id is None:
            return
        desc = self.describe(done, reward, failed)
        try:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.id, round(100.0 * done / self.steps, 1), desc)
        except Exception as exc:
            log.warning("progress artifact not updated: %s", exc)

    def describe(self, done: int, reward: float | None, failed: int = 0) -> str:
        r = "n/a" if reward is None else f"{rounded(float(reward), 3)}"
        return (
            f"{self.run_id}: step {self.first + done} of {self.first + self.steps}, reward {r}, "
            f"{failed} sessions failed"
        )
