"""One validated run config: frozen models per concern, presets, YAML + key=value.

Each section's model lives beside the code it configures (``infra/cells/config.py``,
``infra/engine/config.py``, ``tasks/env/config.py``, ``tasks/train/config.py``,
``infra/gateway/config.py``) and reaches the tasks as that typed object; this module
composes them, holds the presets and reads YAML + ``key=value``. Every error is reported
at once, each naming the setting, the value, why, and the fix, before anything starts::

    gyre run --preset tiny train.steps=3 rollout.group_size=4

Pure module: no prefect, no distributed.
"""

from __future__ import annotations

import copy
import difflib
import os
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.config_yaml import read_config_file
from flows.warmstart import DEMO_SEED0, WarmStartConfig
from infra.cells.config import ClusterConfig
from infra.engine.config import ModelConfig
from infra.gateway.config import GatewayConfig
from storage.paths import RUN_ID_RULE, RunIdError, check_run_id
from tasks.env.config import RolloutConfig
from tasks.env.heldout import EvalConfig, eval_seeds, seed_overlap
from tasks.sched.config import SchedulerConfig, cell_problems
from tasks.train.config import TrainConfig

STORE_PROTOCOLS = ("file", "s3", "s3a", "memory")


class RunConfig(BaseModel):
    """The whole run: one section per concern, each defined beside the code it configures."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    run_id: str | None = Field(
        None,
        description="names the run's data, checkpoints and log; reuse it to continue a run "
        "(letters, digits, '.', '_', '-'; it becomes a path component)",
    )
    store: str = Field("./gyre-data", description="fsspec URL: a directory or s3://bucket/prefix")
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    gateway: GatewayConfig = GatewayConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    eval: EvalConfig = EvalConfig()
    warmstart: WarmStartConfig = WarmStartConfig()

    @model_validator(mode="before")
    @classmethod
    def _sampling_dist(cls, data: Any) -> Any:
        """The trainer scores tokens under the distribution the rollouts sampled from:
        unset ``train.temperature``/``train.top_p`` take the rollout's (greedy rollouts,
        temperature 0, have no distribution: the trainer then uses 1)."""
        if not isinstance(data, dict):
            return data
        rollout = data.get("rollout") or {}
        train = dict(data.get("train") or {})
        if not isinstance(rollout, dict):
            return data
        if train.get("temperature") is None:
            t = rollout.get("temperature", RolloutConfig.model_fields["temperature"].default)
            train["temperature"] = float(t) if isinstance(t, int | float) and t > 0 else 1.0
        if train.get("top_p") is None:
            train["top_p"] = rollout.get("top_p", RolloutConfig.model_fields["top_p"].default)
        return {**data, "train": train}

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                check_run_id(v)
            except RunIdError:
                raise ValueError(f"a run id becomes a directory name: use {RUN_ID_RULE}") from None
        return v

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("empty: give a directory or s3://bucket/prefix")
        if "://" in v and v.split("://", 1)[0] not in STORE_PROTOCOLS:
            raise ValueError(
                f"unknown protocol {v.split('://', 1)[0]!r}: use a directory, file://, "
                "s3:// (s3fs), or memory:// (tests)"
            )
        return v

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        problems = []
        # the engine admits a call only if its input + max_new_tokens fit its KV budget
        if self.model.kv_cache_tokens < 8 * self.rollout.max_new_tokens:
            problems.append(
                f"model.kv_cache_tokens={self.model.kv_cache_tokens}: too small for "
                f"rollout.max_new_tokens={self.rollout.max_new_tokens} (calls would be refused); "
                f"set it to at least {8 * self.rollout.max_new_tokens} plus the context you expect"
            )
        problems += cell_problems(
            self.scheduler, self.cluster.rollout_cells, self.cluster.train_cells
        )
        problems += self._learning_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _learning_problems(self) -> list[str]:
        """Held-out seeds never trained on; a warm start that can be built."""
        problems = []
        r, e = self.rollout, self.eval
        if e.every:
            # groups a run may start: the trained ones plus those in flight when it ends
            groups = 2 * self.train.steps * r.groups_per_step + 4096
            demos = range(DEMO_SEED0, DEMO_SEED0 + self.warmstart.demos)
            hit = seed_overlap(eval_seeds(e), r.seed, groups, [demos])
            if hit:
                problems.append(
                    f"eval.seed0={e.seed0}: held-out seeds {hit[:3]} are also drawn for training "
                    f"(rollout.seed={r.seed}) or the warm start (abs value: CPython seeds "
                    f"random.Random by it); move eval.seed0 away (default {EvalConfig().seed0})"
                )
        if self.warmstart.enabled and not _has_demonstrations(r):
            problems.append(
                f"warmstart.enabled=true: rollout.suite={r.suite!r} has no demonstrations(n, "
                "seed) to learn from; use a suite that has them (tools, repo) or turn "
                "warmstart.enabled off"
            )
        return problems


def _has_demonstrations(r: RolloutConfig) -> bool:
    from tasks.env.suite import SuiteError, load_suite

    try:
        suite = load_suite(r.suite, **r.suite_options())
    except SuiteError:
        return True  # reported by rollout.suite's own check
    return callable(getattr(suite, "demonstrations", None))


# the tools suite's episodes as the demo and tools presets roll them out (one try per turn)
_TOOLS_ROLLOUT: dict[str, Any] = {
    "suite": "tools",
    "difficulty": 1,
    "subtasks": 3,
    "group_size": 8,
    "max_new_tokens": 32,
    "max_attempts": 1,
}

# the long preset's context: the tiny model's positions (its RoPE) must hold one whole
# logbook session (~125K tokens with the chat template); set only where the model section
# has the setting (infra/engine: make_tiny_model(max_position_embeddings=...))
LONG_POSITIONS = 262_144
_LONG_MODEL: dict[str, Any] = {
    # a rollout cell holds up to 2 groups of 2 sessions (~125K tokens each), and a running
    # call holds a copy of its session's KV beside the radix cache's: 8 x 125K. At 2 x
    # LONG_POSITIONS the cache evicted one session's prefix to admit another's call, which
    # then re-prefilled ~80K tokens (30-150 s a call instead of ~1 s)
    "kv_cache_tokens": 4 * LONG_POSITIONS,
    **(
        {"max_position_embeddings": LONG_POSITIONS}
        if "max_position_embeddings" in ModelConfig.model_fields
        else {}
    ),
}

PRESETS: dict[str, dict[str, Any]] = {
    # the smoke test: arithmetic, 2 steps, under a minute on 2 cores (Prefect start included)
    "tiny": {
        "rollout": {"groups_per_step": 1, "group_size": 4, "subtasks": 2, "max_new_tokens": 12},
        "train": {"steps": 2},
        "eval": {"every": 2, "tasks": 4},
    },
    # what `make demo` runs: RL on top of a supervised warm start, judged on held-out tasks
    # (tools suite; about 4-5 minutes on 2 cores, the first time 2 more for the warm start)
    "demo": {
        "rollout": {**_TOOLS_ROLLOUT, "groups_per_step": 2},
        # the warm start learns the format on the one-tool level; RL learns the two-tool
        # level (pick the tool the question names) from reward alone
        "train": {"steps": 50, "lr": 3e-4},
        "warmstart": {"enabled": True, "steps": 200, "difficulty": 0},
        "eval": {"every": 10, "tasks": 32},
    },
    # the tools suite at length: more steps, more held-out tasks
    "tools": {
        "rollout": {**_TOOLS_ROLLOUT, "groups_per_step": 4},
        "train": {"steps": 100, "lr": 3e-4},
        "warmstart": {"enabled": True, "steps": 200, "difficulty": 0},
        "eval": {"every": 20, "tasks": 64},
    },
    # RL on a real pretrained model: SmolLM2-135M-Instruct (`gyre model prepare smollm2`, made
    # on first use) on arithmetic word problems it partly solves (held-out greedy reward
    # 0.2-0.35 at the start; README "Task suites"); no warm start: RL alone must add the gain
    "smol": {
        "model": {"name": "smollm2-135m-instruct", "kv_cache_tokens": 16384},
        "rollout": {
            "suite": "story",
            "difficulty": 1,
            "subtasks": 3,
            "groups_per_step": 2,
            "group_size": 8,
            "max_new_tokens": 24,
            "max_attempts": 1,
            # at 1.0 its samples are mostly noise (sampled reward ~0.06 vs 0.35 greedy)
            "temperature": 0.7,
        },
        # the train cell holds the parked engine and the trainer (fp32 weights, grads and
        # AdamW state: 4 x 0.54 GB), and a micro-batch's logits are tokens x 49,152 floats
        # (4,096 tokens: 0.8 GB, with their log-softmax twice that): at dask's default 6 GiB
        # a cell was killed in its second step
        # 12 steps: held-out 0.312 -> 0.49-0.52 on 3 seeds, 15-32 min a seed on 2 cores
        # (BENCHMARKS.md, "SmolLM2 RL")
        "train": {"steps": 12, "lr": 2e-5, "max_tokens_per_micro": 1024},
        "cluster": {"memory_limit": "8GiB"},
        "eval": {"every": 6, "tasks": 32},
    },
    # the repository-building suite end to end: hidden-test pass fraction before and after
    "repo": {
        "rollout": {
            "suite": "repo",
            "difficulty": 0,
            "groups_per_step": 1,
            "group_size": 2,
            "max_new_tokens": 1024,
            "max_tool_rounds": 12,
            "max_attempts": 1,
            "context_tokens": 8000,
            "timeout_s": 1800.0,
        },
        "train": {"steps": 4, "lr": 3e-4},
        "eval": {"every": 4, "tasks": 4, "timeout_s": 1800.0},
    },
    # issue 24: whole long rollouts trained, nothing cut: one logbook session is 200 turns
    # (one ~570-token log page each) = >= 200 calls on one path, >= 114K tokens of pages;
    # one try per turn and 4 new tokens a call keep it to the prompt's growth; the trainer
    # cuts each path into max_tokens_per_micro chunks (issue 24's chunked training): 2,048,
    # because a chunk's backward holds its attention masks, ~chunk x path x 4 B per layer
    # (peak at 16K tokens: 0.98 GB with 4,096-token chunks, 0.74 with 2,048, 0.63 with 1,024)
    "long": {
        "model": _LONG_MODEL,
        "rollout": {
            "suite": "logbook",
            "difficulty": 1,
            "subtasks": 200,
            "groups_per_step": 1,
            "group_size": 2,
            "max_new_tokens": 4,
            "max_attempts": 1,
            "max_tool_rounds": 1,
            "timeout_s": 3600.0,
        },
        "train": {"steps": 2, "max_tokens_per_micro": 2048},
        # one step trains 2 paths of ~118K tokens: ~4-8 minutes each on 2 CPU cores, more
        # under load; the default 600 s bound on a step took it for a hung member
        "scheduler": {"step_timeout_s": 3600.0},
        "eval": {"every": 0},
    },
}


def preset_help() -> str:
    """One line per preset, from its own settings: suite, steps, what it adds (the Run
    form's and ``--preset``'s help, never out of step with the presets)."""
    out = []
    for name, tree in PRESETS.items():
        cfg = RunConfig.model_validate(tree)
        extra = ", warm start" if cfg.warmstart.enabled else ""
        out.append(
            f"{name} ({cfg.rollout.suite}, {cfg.train.steps} steps, "
            f"{cfg.rollout.groups_per_step}x{cfg.rollout.group_size} sessions per step{extra})"
        )
    return "; ".join(out)


# the settings flows/preflight.py checks against the world (and what it needs for that)
WORLD_KEYS = (
    "store",
    "gateway.port",
    "cluster.scheduler_address",
    "cluster.advertise_host",
    "cluster.rollout_cells",
    "cluster.train_cells",
    "model.path",
    "model.name",
)


class ConfigError(ValueError):
    """All problems of a run config, each with the setting, the value, and the fix.

    ``partial``: the config's valid world settings (`WORLD_KEYS`, the others at their
    defaults), so that the checks against the world still run and are reported with these;
    ``unchecked``: the world settings that are invalid (their checks cannot run)."""

    def __init__(
        self,
        problems: list[str],
        partial: RunConfig | None = None,
        unchecked: frozenset[str] = frozenset(),
    ):
        self.problems = problems
        self.partial = partial
        self.unchecked = unchecked
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


def settings(cfg: RunConfig | None = None) -> list[dict[str, Any]]:
    """Every setting: ``key``, ``value`` (in ``cfg``, default: the defaults), ``default`` and
    ``description``, in the order of the sections (what ``gyre config --list`` prints)."""
    cfg = cfg if cfg is not None else RunConfig()

    def walk(model: type[BaseModel], obj: Any, prefix: str) -> list[dict[str, Any]]:
        out = []
        for name, field in model.model_fields.items():
            ann, value = field.annotation, getattr(obj, name)
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out += walk(ann, value, f"{prefix}{name}.")
            else:
                out.append(
                    {
                        "key": f"{prefix}{name}",
                        "value": value,
                        "default": field.get_default(call_default_factory=True),
                        "description": field.description or "",
                    }
                )
        return out

    return walk(RunConfig, cfg, "")


def settings_text(cfg: RunConfig | None = None, changed_only: bool = False) -> str:
    """``settings`` as lines a user can copy as ``key=value``: the value, then the meaning
    and (where the value differs) the default as a comment; ``changed_only``: the settings
    whose value is not the default."""
    import textwrap

    # a setting left at None resolves from another (train.temperature from rollout's): it
    # differs from the default only where its resolved value differs from a default run's
    resolved = {s["key"]: s["value"] for s in settings(RunConfig())}
    lines = []
    for s in settings(cfg):
        default = resolved.get(s["key"], s["default"])
        if changed_only and s["value"] == default:
            continue
        value = yaml.safe_dump(s["value"], default_flow_style=True).strip().removesuffix("...")
        value = value.strip()
        lines.append(f"{s['key']}={value}")
        note = s["description"]
        if s["value"] != default:
            note += f" (default {default!r})"
        lines += textwrap.wrap(note, 100, initial_indent="    # ", subsequent_indent="    # ")
    return "\n".join(lines)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise TypeError(key)
    node[parts[-1]] = value


def _drop_dotted(tree: dict[str, Any], key: str) -> None:
    """Remove ``key`` and the sections it leaves empty."""
    head, _, rest = key.partition(".")
    if rest and isinstance(tree.get(head), dict):
        _drop_dotted(tree[head], rest)
        if not tree[head]:
            del tree[head]
    elif not rest:
        tree.pop(head, None)


def _world_part(tree: dict[str, Any]) -> tuple[RunConfig | None, frozenset[str]]:
    """The valid world settings of ``tree`` as a config (the rest at defaults), and the
    world settings given with an invalid value."""
    flat = _flatten(tree)
    part: dict[str, Any] = {}
    bad = set()
    for key in WORLD_KEYS:
        if key not in flat:
            continue
        one: dict[str, Any] = {}
        _set_dotted(one, key, flat[key])
        try:
            RunConfig.model_validate(one)
        except ValidationError:
            bad.add(key)
            continue
        _set_dotted(part, key, flat[key])
    try:
        return RunConfig.model_validate(part), frozenset(bad)
    except ValidationError:  # valid one by one, not together: no world checks
        return None, frozenset(bad)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_scalar(raw: str) -> Any:
    """A ``key=value`` value as YAML would read it, plus ``1e-3`` as a float (YAML 1.1
    needs ``1.0e-3``) unless quoted (``'1e-3'`` is a string, refused where a number is due);
    anything unparsable stays a string for the model to judge, and so
    does ``a: b`` (a mapping only in braces: ``rollout.harness=cmd: python agent.py``)."""
    if not raw.strip():
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, str) and raw.strip()[:1] not in ("'", '"'):
        try:
            return float(value)
        except ValueError:
            return value
    if isinstance(value, dict) and not raw.lstrip().startswith("{"):
        return raw.strip()  # `cmd: python agent.py` is a string, not a YAML mapping
    return value


def load_config(
    *,
    config_file: str | os.PathLike | None = None,
    preset: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    store: str | None = None,
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """Preset, then YAML file, then ``--store``, then ``key=value`` overrides; validated once.

    ``base``: a resolved config (a resumed run's stored one) to start from instead of a preset.
    """
    problems: list[str] = []
    tree: dict[str, Any] = copy.deepcopy(base) if base is not None else {}
    if preset is not None and base is None:
        if preset not in PRESETS:
            problems.append(f"--preset {preset!r}: unknown preset; use one of {sorted(PRESETS)}")
        else:
            tree = _merge(tree, copy.deepcopy(PRESETS[preset]))
    if config_file is not None:
        try:
            data = read_config_file(config_file) or {}
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
        value = parse_scalar(raw)
        try:
            _set_dotted(tree, key, value)
        except TypeError:
            problems.append(f"{key}={raw}: {key.rsplit('.', 1)[0]} is not a section")
    for key, value in _flatten(tree).items():
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(known)}"
            problems.append(f"{key}={value!r}: unknown setting; {fix}")
            _drop_dotted(tree, key)  # the known ones are still checked, all reported at once
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            given = err.get("input")
            msg = err["msg"]
            if msg.startswith("Value error, "):  # ours: it already says what to do
                msg = msg.removeprefix("Value error, ")
            else:
                msg += f"; fix: set {loc} to a valid value"
            problems.append(f"{loc}={given!r}: {msg}" if loc != "config" else msg)
    else:
        if not problems:
            return cfg
    raise ConfigError(problems, *_world_part(tree))
