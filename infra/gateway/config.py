"""Settings of the gateway (the `gateway` section of a run config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GatewayConfig(BaseModel):
    """Where the OpenAI-compatible gateway listens."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    port: int = Field(0, ge=0, le=65535, description="0 = any free port")
    max_body_mb: int = Field(
        64,
        ge=1,
        le=4096,
        description="a request body larger than this many MiB is refused (413) before it is "
        "parsed; 64 holds a ~2M-token conversation (infra/gateway/core.py, MAX_BODY_BYTES)",
    )
