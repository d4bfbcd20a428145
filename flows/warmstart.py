"""``gyre warmstart``: a supervised warm start of a model on a suite's demonstrations.

RL on a randomly initialised model has nothing to reinforce: the tiny model never emits a
well-formed tool call by chance. A short supervised pass on correct transcripts of the
suite (``Suite.demonstrations(n, seed)``: OpenAI messages exactly as the built-in harness
sends them) teaches it the format; stopped early, it leaves RL room to add on top::

    gyre warmstart --suite tools --difficulty 1 --steps 100      # prints the checkpoint dir
    gyre run model.path=DIR rollout.suite=tools ...

or, without a separate command, ``warmstart.enabled=true`` in a run config (the ``demo``
and ``tools`` presets): the run builds the same checkpoint on first use and reuses it
afterwards. The base is the tiny model (``model.seed``), or the run's own checkpoint when
it names one (``model.path``, ``model.name``; ``gyre warmstart --model DIR``): any local HF
checkpoint the trainer loads (Llama, Qwen2, Qwen3 families).

Deterministic and cached: the pass runs on one torch thread (``THREADS``: the order of a
CPU matmul's sums, hence the low bits, depends on the thread count; one thread is also the
fastest on a shared two-core machine), and the checkpoint is a function of its settings
(``WarmStartConfig``: steps, rate, batch, demonstrations, seeds; the suite, difficulty and
sub-tasks) and of its base (the tiny model's recipe and seed, or a given checkpoint's
`fingerprint`: its files' bytes); it is written once to
``$GYRE_CACHE/warmstart/<suite>-d<difficulty>-<key>/`` (built in a temporary sibling and
renamed into place, so concurrent callers never see half a checkpoint) and returned as is
afterwards. ``warm_start.json`` in it records the settings, the losses and the build time.

Demonstrations come from task seeds ``DEMO_SEED0 + k``: far from the seeds training
derives (``rollout.seed * 1_000_003 + index * 1009``) and from the held-out evaluation
seeds (tasks/evaluate.py), so the warm start never sees a task it is evaluated on.

No prefect, no distributed: torch and transformers only (tasks/train/sft.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from storage.paths import cache_dir

log = logging.getLogger(__name__)

DEMO_SEED0 = 9_000_000_000_000  # demonstration task seeds: DEMO_SEED0 + k
RECIPE_VERSION = 2  # bump when the recipe below changes: cached warm starts are rebuilt
THREADS = 1  # torch threads of the pass: the sums' order, hence the bits, depend on it
_MARKER = ".gyre-warmstart-complete"


class WarmStartError(RuntimeError):
    """The warm start cannot be built as asked (the message names the setting and the fix)."""


class WarmStartConfig(BaseModel):
    """The ``warmstart`` section: a supervised pass before RL (tasks/train/sft.py).

    With ``enabled`` the run's initial weights are this warm start of the tiny model
    (``model.seed``) on ``rollout.suite``'s demonstrations at ``rollout.difficulty`` and
    ``rollout.subtasks`` (or ``warmstart.difficulty`` / ``warmstart.subtasks``); built on
    first use, cached afterwards."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    enabled: bool = Field(False, description="start the run from a supervised warm start")
    steps: int = Field(100, ge=1, le=100_000, description="AdamW steps of the supervised pass")
    lr: float = Field(3e-3, gt=0, le=1.0, description="AdamW learning rate of the pass")
    batch_size: int = Field(16, ge=1, le=4096, description="demonstrations per step")
    demos: int = Field(512, ge=1, le=1_000_000, description="distinct demonstrations")
    difficulty: int | None = Field(
        None,
        ge=0,
        le=10,
        description="the suite difficulty of the demonstrations (None: rollout.difficulty); "
        "an easier level teaches the format and leaves the harder level's choices to RL",
    )
    subtasks: int | None = Field(
        None,
        ge=1,
        le=32,
        description="sub-tasks per demonstration (None: rollout.subtasks); a longer "
        "transcript teaches more per step, and a shorter episode is its prefix",
    )
    seed: int = Field(0, description="shuffle and init seed of the supervised pass")


# the files of a checkpoint that decide what it computes and how it tokenizes
_BASE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")  # fmt: skip


def fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 of a checkpoint directory's weights (``*.safetensors``, ``*.bin``), config and
    tokenizer files, by name: a warm start's cache key for a given base (the path alone would
    reuse a stale warm start after the checkpoint there changed)."""
    root = Path(model_dir)
    names = sorted(
        p.name
        for p in root.iterdir()
        if p.is_file() and (p.name in _BASE_FILES or p.suffix in (".safetensors", ".bin"))
    )
    h = hashlib.sha256()
    for name in names:
        h.update(f"{name}|".encode())
        with open(root / name, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def spec(
    cfg: WarmStartConfig,
    *,
    suite: str,
    difficulty: int,
    subtasks: int,
    model_seed: int,
    base: str | os.PathLike | None = None,
):
    """Everything the checkpoint depends on, as a plain dict (its cache key). ``base``: a
    given checkpoint to start from (None: the tiny model of ``model_seed``)."""
    from infra.engine.tiny_model import FORMAT_VERSION

    common = {
        "recipe": RECIPE_VERSION,
        "suite": suite,
        "difficulty": difficulty,
        "subtasks": subtasks,
        "steps": cfg.steps,
        "lr": cfg.lr,
        "batch_size": cfg.batch_size,
        "demos": cfg.demos,
        "seed": cfg.seed,
        "demo_seed0": DEMO_SEED0,
        "threads": THREADS,
    }
    if base is not None:  # a given checkpoint: its fingerprint instead of the tiny recipe
        return {**common, "base": fingerprint(base)}
    return {**common, "tiny_model": FORMAT_VERSION, "model_seed": model_seed}


def default_dir(s: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:12]
    name = s["suite"].replace(":", "-").replace(".", "-").replace("/", "-")
    return cache_dir() / "warmstart" / f"{name}-d{s['difficulty']}-{key}"


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / _MARKER).is_file()


def demonstrations(suite_name: str, difficulty: int, subtasks: int, n: int) -> list[Any]:
    """``n`` demonstrations of the suite (task seeds ``DEMO_SEED0 + k``)."""
    from tasks.env.suite import load_suite

    suite = load_suite(suite_name, difficulty=difficulty, subtasks=subtasks)
    if not callable(getattr(suite, "demonstrations", None)):
        raise WarmStartError(
            f"suite {suite_name!r} has no demonstrations(n, seed): a warm start needs correct "
            "transcripts; use a suite that has them (tools, repo) or set warmstart.enabled=false"
        )
    return list(suite.demonstrations(n, DEMO_SEED0))


def build_warmstart(
    cfg: WarmStartConfig,
    *,
    suite: str,
    difficulty: int = 1,
    subtasks: int = 3,
    model_seed: int = 0,
    base: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    force: bool = False,
    say: Any = None,
    progress: Any = None,
) -> tuple[str, dict[str, Any]]:
    """The warm-start checkpoint for these settings: (directory, its ``warm_start.json``).

    Returned as is when ``out`` (default: the cache) already holds it, unless ``force``.
    ``base``: the checkpoint to start from (None: the tiny model of ``model_seed``).
    ``say``: a line before a build starts (it takes minutes); ``progress``: a stream for
    the build's progress bar (steps and loss).
    """
    import torch

    from infra.engine.tiny_model import make_tiny_model
    from tasks.train.sft import META_FILE, warm_start

    s = spec(cfg, suite=suite, difficulty=difficulty, subtasks=subtasks, model_seed=model_seed,
             base=base)  # fmt: skip
    dest = Path(out) if out is not None else default_dir(s)
    if is_complete(dest) and not force:
        meta = json.loads((dest / META_FILE).read_text())
        if meta.get("spec") == s:
            return str(dest), {**meta, "cached": True}
        if out is None:  # pragma: no cover - a hash collision in the cache
            raise WarmStartError(f"{dest} holds another warm start; remove it")
        force = True  # an explicit --out with other settings: rebuild it
    start = str(base) if base is not None else make_tiny_model(seed=model_seed)
    if say is not None:
        say(
            f"building the warm start: {cfg.steps} supervised steps on {cfg.demos} {suite} "
            f"demonstrations (once; cached in {dest})"
        )
    t0 = time.monotonic()
    demos = demonstrations(suite, difficulty, subtasks, cfg.demos)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        res = warm_start(
            start,
            demos,
            str(tmp),
            steps=cfg.steps,
            lr=cfg.lr,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            progress=progress,
        )
        meta = json.loads((tmp / META_FILE).read_text())
        meta.update(
            spec=s,
            # not the local path: the file is the same on every machine
            base="tiny-qwen3" if base is None else Path(base).name,
            seconds=round(time.monotonic() - t0, 1),
            first_loss=res.losses[0],
            final_loss=res.losses[-1],
        )
        (tmp / META_FILE).write_text(json.dumps(meta))
        (tmp / _MARKER).write_text(json.dumps(s))
        if force and dest.exists():
            shutil.rmtree(dest)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_complete(dest):
                raise WarmStartError(f"{dest} exists and is not a warm start: remove it") from None
            # another process built the same settings first: same result, keep theirs
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads((dest / META_FILE).read_text())
    log.info("warm start %s: %d steps in %.1fs", dest, cfg.steps, meta["seconds"])
    return str(dest), {**meta, "cached": False}


def for_run(cfg: Any, say: Any = None, base: str | None = None) -> str | None:
    """The run's initial model when ``cfg.warmstart.enabled`` (built on first use, saying so
    through ``say``, with a progress bar on stderr), else None. ``base``: the run's own
    checkpoint (``model.path``, a prepared ``model.name``) to start from, else the tiny
    model of ``model.seed``."""
    import sys

    ws = cfg.warmstart
    if not ws.enabled:
        return None
    r = cfg.rollout
    path, _ = build_warmstart(
        ws,
        suite=r.suite,
        difficulty=r.difficulty if ws.difficulty is None else ws.difficulty,
        subtasks=ws.subtasks or r.subtasks,
        model_seed=cfg.model.seed,
        base=base,
        say=say,
        progress=sys.stderr,
    )
    return path


def main_warmstart(args: Any) -> int:
    """``gyre warmstart``: build (or find) the checkpoint, print where it is and what it cost."""
    import sys

    from pydantic import ValidationError

    from tasks.env.suite import SuiteError, check_suite

    try:
        cfg = WarmStartConfig(
            enabled=True,
            steps=args.steps,
            lr=args.lr,
            batch_size=args.batch_size,
            demos=args.demos,
            seed=args.seed,
        )
    except ValidationError as exc:
        problems = [f"--{'-'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        print("gyre warmstart: " + "; ".join(problems), file=sys.stderr)
        return 2
    problems = check_suite(
        args.suite, {"difficulty": args.difficulty, "subtasks": args.subtasks}, key="--suite"
    )
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        problems.append(f"--model {args.model}: not a checkpoint directory (no config.json)")
    if problems:
        print("gyre warmstart: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        path, meta = build_warmstart(
            cfg,
            suite=args.suite,
            difficulty=args.difficulty,
            subtasks=args.subtasks,
            model_seed=args.model_seed,
            base=args.model,
            out=args.out,
            force=args.force,
            say=lambda line: print(f"gyre warmstart: {line}", file=sys.stderr, flush=True),
            progress=sys.stderr,
        )
    except (WarmStartError, SuiteError) as exc:
        print(f"gyre warmstart: {exc}", file=sys.stderr)
        return 2
    how = "cached" if meta["cached"] else f"built in {meta['seconds']:.1f}s"
    print(
        f"gyre warmstart: {path} ({how}; {meta['steps']} steps on {meta['conversations']} "
        f"demonstrations, loss {meta['first_loss']:.3f} -> {meta['final_loss']:.3f})"
    )
    print(
        f"use it:  gyre run model.path={path} rollout.suite={args.suite} "
        f"rollout.difficulty={args.difficulty} rollout.subtasks={args.subtasks}"
    )
    return 0
