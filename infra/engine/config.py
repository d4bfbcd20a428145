"""Settings of the model and its engines (the `model` section of a run config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ModelConfig(BaseModel):
    """The policy model and the embedded engine that serves it on each rollout cell."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    path: str | None = Field(
        None, description="local HF checkpoint dir; None = tiny Qwen3 made here"
    )
    seed: int = 0
    max_batch_size: int = Field(16, ge=1)
    kv_cache_tokens: int = Field(262_144, ge=1024)
    audit_dir: str | None = Field(
        None,
        description="each engine appends every request it receives (rid, input ids) to "
        "{audit_dir}/{cell_id}.jsonl, to audit token exactness against TITO",
    )
