"""What a run shows in the Prefect UI besides its logs: artifacts with rounded figures.

- a progress artifact, "step k of N, reward r, f sessions failed", updated after every
  optimizer step;
- the resolved settings of the run (markdown, YAML);
- the summary table, with the query that shows the run's steps.

Artifact keys may hold lowercase letters, digits and dashes only; every function here is
best effort (a UI that cannot be reached must not fail a run that trains).
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import yaml

log = logging.getLogger(__name__)


def artifact_key(prefix: str, run_id: str) -> str:
    """``prefix-<run id as lowercase letters, digits and dashes>``."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")


def rounded(v: Any, digits: int = 4) -> Any:
    """Floats to ``digits`` significant digits (integers, strings and None unchanged)."""
    if isinstance(v, float) and math.isfinite(v) and v != 0:
        return float(f"{v:.{digits}g}")
    return v


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
    """One progress artifact per run: ``step k of N, reward r, f sessions failed``."""

    def __init__(self, run_id: str, first_step: int, steps: int):
        self.first, self.steps = first_step, max(1, steps)
        self.id = None
        try:
            from prefect.artifacts import create_progress_artifact

            self.id = create_progress_artifact(
                0.0,
                key=artifact_key("gyre-progress", run_id),
                description=f"{run_id}: step {first_step} of {first_step + steps}, starting",
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
