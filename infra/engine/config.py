"""Settings of the model and its engines (the `model` section of a run config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra.engine.pretrained import NAMES, PretrainedError, lookup


class ModelConfig(BaseModel):
    """The policy model and the embedded engine that serves it on each rollout cell."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    path: str | None = Field(
        None, description="local HF checkpoint dir; None = tiny Qwen3 made here (or model.name)"
    )
    name: str | None = Field(
        None,
        description=f"a pretrained model gyre prepares itself ({', '.join(NAMES)}): its "
        "checkpoint in the model cache, made on first use (`gyre model prepare`)",
    )
    seed: int = Field(0, description="seed of the tiny model's initial weights")
    max_batch_size: int = Field(
        16, ge=1, description="requests an engine decodes together (continuous batching)"
    )
    max_position_embeddings: int = Field(
        32_768,
        ge=1024,
        description="the tiny model's context in positions (its RoPE is plain, so any length "
        "up to this is exact); a checkpoint (model.path / model.name) keeps its own",
    )
    kv_cache_tokens: int = Field(
        262_144, ge=1024, description="an engine's KV cache budget in tokens (radix cache included)"
    )
    audit_dir: str | None = Field(
        None,
        description="each engine appends every request it receives (rid, input ids) to "
        "{audit_dir}/{cell_id}.jsonl, to audit token exactness against TITO",
    )

    @field_validator("name")
    @classmethod
    def _known_name(cls, v: str | None) -> str | None:
        if v is None:
            return None
        try:
            return lookup(v).name  # an alias (smollm2) stands for its model
        except PretrainedError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _one_model(self) -> ModelConfig:
        if self.path is not None and self.name is not None:
            raise ValueError(
                f"model.path={self.path!r} and model.name={self.name!r}: give one of them"
            )
        return self
