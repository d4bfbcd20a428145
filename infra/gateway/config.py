"""Settings of the gateway (the `gateway` section of a run config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GatewayConfig(BaseModel):
    """Where the OpenAI-compatible gateway listens."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    port: int = Field(0, ge=0, le=65535, description="0 = any free port")
