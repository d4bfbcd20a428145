"""Settings of the cells (the `cluster` section of a run config)."""

from __future__ import annotations

import ipaddress
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

# what dask's parse_bytes reads: "6GiB", "512 MB", "2e9", "auto"; 0 = no limit
_MEMORY = re.compile(r"^(auto|0|\d+(\.\d+)?(e\d+)?\s*([kKMGTP]i?B|B)?)$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-]{0,252})$")
LOOPBACK = "127.0.0.1"
_ADDRESS = re.compile(r"^(tcp|tls|ucx|ws|wss)://[A-Za-z0-9.\-_\[\]:]+:\d{1,5}$")


class ClusterConfig(BaseModel):
    """Dask cells: one worker process per cell (a LocalCluster unless an address is given)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    rollout_cells: int = Field(1, ge=1, description="cells holding an engine")
    train_cells: int = Field(1, ge=1, description="cells holding a trainer replica")
    threads_per_cell: int = Field(
        2, ge=1, description="threads of each cell's worker process (torch and the engine)"
    )
    memory_limit: str = Field(
        "6GiB", description="per cell, as dask reads it: 6GiB, 512MB, auto, or 0 for no limit"
    )
    scheduler_address: str | None = Field(
        None, description="tcp://host:8786 of an external `dask scheduler`; None = LocalCluster"
    )
    advertise_host: str = Field(
        LOOPBACK,
        description="the address of this host that the run's endpoints (gateway, DP "
        "rendezvous, a LocalCluster and its dashboard) bind and advertise; other hosts' cells "
        "must reach it. Beyond loopback, engines on cells (which bind their own worker's "
        "address) require the run's token",
    )
    heal_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86_400,
        description="a cell whose worker died must get a new worker within this (the nanny "
        "restarts it), else the run stops with an error",
    )

    @field_validator("memory_limit")
    @classmethod
    def _memory(cls, v: str) -> str:
        if not _MEMORY.match(v.strip()):
            raise ValueError("not a size: write it like 6GiB, 512MB, auto, or 0 (no limit)")
        return v.strip()

    @field_validator("advertise_host")
    @classmethod
    def _host(cls, v: str) -> str:
        v = v.strip()
        if v in ("0.0.0.0", "::", "*") or not _HOST.match(v):
            raise ValueError(
                "not an address to advertise: give this host's IP or name as the other hosts "
                "reach it (e.g. 10.0.0.5), or 127.0.0.1 for a run on one host"
            )
        return v

    @field_validator("scheduler_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not _ADDRESS.match(v.strip()):
            raise ValueError("not a scheduler address: write it like tcp://host:8786")
        return v.strip() if v else v


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP or a name) is this machine's loopback: endpoints bound there
    are reachable from this host only, and need no token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
