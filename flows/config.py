"""One validated run config: frozen models per concern, presets, YAML + key=value.

Every error is reported at once, each naming the setting, the value, why, and
the fix, before anything starts::

    gyre run --preset tiny train.steps=3 rollout.group_size=4

Pure module: no prefect, no distributed.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClusterConfig(_Frozen):
    """Dask cells: one worker process per cell (a LocalCluster unless an address is given)."""

    rollout_cells: int = Field(1, ge=1, description="cells holding an engine")
    train_cells: int = Field(1, ge=1, description="cells holding a trainer replica")
    threads_per_cell: int = Field(2, ge=1)
    memory_limit: str = "6GiB"
    scheduler_address: str | None = Field(
        None, description="tcp://host:8786 of an external `dask scheduler`; None = LocalCluster"
    )


class ModelConfig(_Frozen):
    path: str | None = Field(
        None, description="local HF checkpoint dir; None = tiny Qwen3 made here"
    )
    seed: int = 0
    max_batch_size: int = Field(16, ge=1)
    kv_cache_tokens: int = Field(262_144, ge=1024)


class RolloutConfig(_Frozen):
    env: Literal["arith"] = "arith"
    groups_per_step: int = Field(1, ge=1, description="tasks per step (GRPO groups)")
    group_size: int = Field(4, ge=1, description="sessions per task")
    subtasks: int = Field(3, ge=1, le=32)
    max_attempts: int = Field(2, ge=1, description="tries per sub-task (retries become branches)")
    summarize_every: int = Field(
        0, ge=0, description="harness resets its context every N sub-tasks (0 = never)"
    )
    max_new_tokens: int = Field(16, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    timeout_s: float = Field(600.0, gt=0)
    seed: int = 0


class TrainConfig(_Frozen):
    steps: int = Field(2, ge=1)
    lr: float = Field(1e-3, gt=0, le=1.0)
    loss: Literal["ppo_clip", "grpo"] = "ppo_clip"
    advantage: Literal["grpo", "per_subtask"] = "grpo"
    clip_eps_low: float = Field(0.2, ge=0, le=1)
    clip_eps_high: float = Field(0.28, ge=0, le=10)
    max_tokens_per_micro: int = Field(4096, ge=64)
    max_staleness: int = Field(1, ge=0, description="policy versions a token may lag")
    stale_policy: Literal["drop", "is"] = "drop"
    is_cap: float = Field(2.0, gt=0)
    reward_aggregation: Literal["weighted_mean", "sum", "min", "all_or_nothing"] = "weighted_mean"
    seed: int = 0


class GatewayConfig(_Frozen):
    port: int = Field(0, ge=0, le=65535, description="0 = any free port")


class RunConfig(_Frozen):
    run_id: str | None = None
    store: str = "./gyre-data"
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    gateway: GatewayConfig = GatewayConfig()

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        problems = []
        if self.model.path is not None and not Path(self.model.path).is_dir():
            problems.append(
                f"model.path={self.model.path!r}: no such directory; "
                "give a local HF checkpoint dir or leave it unset for the tiny model"
            )
        # the engine admits a call only if its input + max_new_tokens fit its KV budget
        if self.model.kv_cache_tokens < 8 * self.rollout.max_new_tokens:
            problems.append(
                f"model.kv_cache_tokens={self.model.kv_cache_tokens}: too small for "
                f"rollout.max_new_tokens={self.rollout.max_new_tokens} (calls would be refused); "
                f"set it to at least {8 * self.rollout.max_new_tokens} plus the context you expect"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


PRESETS: dict[str, dict[str, Any]] = {
    # under 3 minutes on 2 cores, Prefect start included
    "tiny": {
        "rollout": {"groups_per_step": 1, "group_size": 4, "subtasks": 2, "max_new_tokens": 12},
        "train": {"steps": 2},
    },
    # what `make demo` runs: more sessions, retries and a context reset per session
    "demo": {
        "rollout": {
            "groups_per_step": 2,
            "group_size": 4,
            "subtasks": 4,
            "max_new_tokens": 16,
            "summarize_every": 2,
        },
        # a high rate so that 8 steps move the tiny policy visibly (reward in `steps`)
        "train": {"steps": 8, "lr": 0.01},
    },
}


class ConfigError(ValueError):
    """All problems of a run config, each with the setting, the value, and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid run config:\n" + "\n".join(f"  - {p}" for p in problems))


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _known_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise TypeError(key)
    node[parts[-1]] = value


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_config(
    *,
    config_file: str | os.PathLike | None = None,
    preset: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    store: str | None = None,
) -> RunConfig:
    """Preset, then YAML file, then ``--store``, then ``key=value`` overrides; validated once."""
    problems: list[str] = []
    tree: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            problems.append(f"--preset {preset!r}: unknown preset; use one of {sorted(PRESETS)}")
        else:
            tree = _merge(tree, PRESETS[preset])
    if config_file is not None:
        try:
            data = yaml.safe_load(Path(config_file).read_text()) or {}
            if not isinstance(data, dict):
                raise ValueError("top level must be a mapping")
            tree = _merge(tree, data)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            problems.append(f"--config {config_file}: cannot read: {exc}; fix the file or path")
    if store is not None:
        tree["store"] = store
    known = _known_keys(RunConfig)
    for item in overrides:
        if "=" not in item:
            problems.append(f"{item!r}: overrides are key=value, e.g. train.steps=3")
            continue
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        try:
            _set_dotted(tree, key, value)
        except TypeError:
            problems.append(f"{key}={raw}: {key.rsplit('.', 1)[0]} is not a section")
    for key, value in _flatten(tree).items():
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(known)}"
            problems.append(f"{key}={value!r}: unknown setting; {fix}")
    if not problems:
        try:
            return RunConfig.model_validate(tree)
        except ValidationError as exc:
            for err in exc.errors():
                loc = ".".join(str(p) for p in err["loc"]) or "config"
                given = err.get("input")
                msg = err["msg"]
                problems.append(
                    f"{loc}={given!r}: {msg}; fix: set {loc} to a valid value"
                    if loc != "config"
                    else msg
                )
    raise ConfigError(problems)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return cfg.model_dump(mode="json")
