"""Settings of the cells (the `cluster` section of a run config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ClusterConfig(BaseModel):
    """Dask cells: one worker process per cell (a LocalCluster unless an address is given)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    rollout_cells: int = Field(1, ge=1, description="cells holding an engine")
    train_cells: int = Field(1, ge=1, description="cells holding a trainer replica")
    threads_per_cell: int = Field(2, ge=1)
    memory_limit: str = "6GiB"
    scheduler_address: str | None = Field(
        None, description="tcp://host:8786 of an external `dask scheduler`; None = LocalCluster"
    )
