"""The task-suite contract: what a suite, its environments, a harness and an evaluator are.

A run names its tasks with one dotted path, ``rollout.suite`` (``module:attr``), and the agent
that works on them with ``rollout.harness``. Both are checked when the config is validated,
before anything starts, and every problem is reported at once (``check_suite``,
``check_harness``).

Suite (``rollout.suite``, e.g. ``tasks.env.tools:ToolsSuite`` or ``mypkg.suites:MySuite``)
    A class or factory, called with the keyword options it names out of ``difficulty``,
    ``subtasks`` and ``isolation`` (see ``SUITE_OPTIONS``; ``**kwargs`` takes all). The object
    it returns has:

    - ``name: str``
    - ``task(seed: int) -> Task``: deterministic in ``seed`` (same seed, same task; a run
      derives one seed per group, held-out evaluation uses seeds never trained on);
    - ``start(task: Task, workdir: str) -> Env``: the live state of one session (each session
      of a GRPO group gets its own, on the same task); ``workdir`` is an empty private
      directory the caller removes afterwards;
    - ``evaluate(env: Env, outcome: Outcome) -> list[SubtaskScore]``: the final state ->
      one score per declared sub-task, unfinished ones included (score 0, with the outcome's
      status and a reason). This is the evaluator; it may run hidden tests.

Env (returned by ``start``)
    - ``task: Task``, ``system_prompt: str``, ``tools: list[dict]`` (OpenAI tool schemas),
      ``turns: list[Turn]`` (the user turns, in order), ``workdir: str``,
      ``max_tool_rounds: int`` (tool rounds a turn needs; the harness's default);
    - ``call_tool(turn_id, name, arguments, request_id) -> str``: run one tool call made in
      the reply ``request_id`` (the gateway's response id) and return the tool message text;
    - ``submit(turn_id, text, request_id) -> float | None``: the turn's final reply; returns
      immediate feedback in [0, 1] (the built-in harness retries below 1.0) or None;
    - ``progress() -> str``: a one-line account of the work so far (context summaries);
    - ``close()``.

Harness (``rollout.harness``): the agent, a black box that only knows a base URL and a key.
    - ``builtin``: ``tasks.env.harness.run_agent``, the official ``openai`` client only.
    - ``module:callable``: called with a ``HarnessContext``; may be async; returns a
      ``HarnessResult`` (or None). It reaches the environment through ``ctx.env``.
    - ``cmd:COMMAND ARGS``: a subprocess (``shlex`` split, no shell) with the variables
      ``OPENAI_BASE_URL`` (``…/v1``), ``OPENAI_API_KEY`` (so an unmodified OpenAI-client
      agent just works), ``GYRE_TASK_FILE`` (JSON: task id, system prompt, tools, turns, task
      data), ``GYRE_WORKDIR`` (its cwd: the repository suite's workspace) and
      ``GYRE_OUTPUT``, a JSON file it may write (relative paths in the command that name
      existing files are made absolute first, since it runs in its workdir)::

          {"answers": {"TURN_ID": {"text": "...", "request_id": "chatcmpl-..."}},
           "tool_calls": {"TURN_ID": [{"name": "...", "arguments": {...},
                                       "request_id": "..."}]}}

      Tool calls are replayed into the environment, then answers submitted, then the suite
      evaluates (a repository is judged on the files left in ``GYRE_WORKDIR``).

Scores land in the store's ``scores`` dataset (``storage/schemas.py``) with ``source``
``env`` (graded as the session went) or ``evaluator`` (judged after it), and ``at_request_id``
the call whose reply earned the score where known (the trajectory tree attaches it there).

Pure module: no prefect, no distributed.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shlex
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

STATUSES = ("finished", "failed", "timeout", "unfinished")
SUITE_OPTIONS = ("difficulty", "subtasks", "isolation")
SUITE_METHODS = ("task", "start", "evaluate")
ENV_METHODS = ("call_tool", "submit", "progress", "close")
ENV_ATTRS = ("task", "system_prompt", "tools", "turns", "workdir", "max_tool_rounds")

BUILTIN_SUITES = {
    "arith": "tasks.env.arith:ArithSuite",
    "tools": "tasks.env.tools:ToolsSuite",
    "repo": "tasks.env.repo:RepoSuite",
    "story": "tasks.env.story:StorySuite",
    "logbook": "tasks.env.logbook:LogbookSuite",
}


class SuiteError(ValueError):
    """A suite or harness that cannot be used as configured: every problem, with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class SubtaskSpec:
    subtask_id: str
    weight: float = 1.0
    description: str = ""


@dataclass(frozen=True)
class Turn:
    """One user turn the harness sends; ``turn_id`` is what tool calls and answers name."""

    turn_id: str
    prompt: str


@dataclass(frozen=True)
class Task:
    """One task (a GRPO group shares it). ``data`` is JSON-able: what a ``cmd:`` harness
    gets besides the turns (e.g. the repository spec's name)."""

    task_id: str
    seed: int
    subtasks: tuple[SubtaskSpec, ...]
    data: Mapping[str, Any] = field(default_factory=dict)

    @property
    def weights(self) -> dict[str, float]:
        return {s.subtask_id: s.weight for s in self.subtasks}


@dataclass(frozen=True)
class Outcome:
    """How the harness run ended, as the rollout saw it."""

    status: str  # finished | failed | timeout
    reason: str = ""
    calls: int = 0


@dataclass(frozen=True)
class SubtaskScore:
    subtask_id: str
    score: float
    weight: float = 1.0
    at_request_id: str | None = None
    status: str = "finished"  # finished | failed | timeout | unfinished
    reason: str = ""
    source: str = "env"  # env | evaluator | harness

    def __post_init__(self) -> None:
        if not 0.0 <= self.score <= 1.0:
            raise ValueError(f"sub-task {self.subtask_id!r}: score {self.score} not in [0, 1]")
        if self.status not in STATUSES:
            raise ValueError(f"sub-task {self.subtask_id!r}: status {self.status!r}")

    def row(self) -> dict[str, Any]:
        """The ``scores`` row (without run/session ids)."""
        return {
            "subtask_id": self.subtask_id,
            "score": float(self.score),
            "weight": float(self.weight),
            "at_request_id": self.at_request_id,
            "source": self.source,
            "status": self.status,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class HarnessSettings:
    """What the built-in harness does with the model; ``cmd:`` harnesses get none of it."""

    model: str = "gyre"
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    max_attempts: int = 2
    retry_below: float = 1.0
    max_tool_rounds: int = 0  # 0: the environment's own
    summarize_every: int = 0
    context_tokens: int = 0  # 0: no budget
    context_policy: str = "summarize"  # summarize | truncate
    timeout_s: float = 600.0


@dataclass(frozen=True)
class HarnessContext:
    base_url: str  # the gateway's root; the OpenAI base URL is base_url + "/v1"
    api_key: str
    env: Any  # an Env
    settings: HarnessSettings = HarnessSettings()


@dataclass(frozen=True)
class HarnessResult:
    calls: int = 0
    last_request_id: str | None = None
    compactions: int = 0  # context compactions (each one starts a branch)


Harness = Callable[[HarnessContext], Awaitable[HarnessResult | None] | HarnessResult | None]


@runtime_checkable
class Suite(Protocol):
    name: str

    def task(self, seed: int) -> Task: ...
    def start(self, task: Task, workdir: str) -> Any: ...
    def evaluate(self, env: Any, outcome: Outcome) -> list[SubtaskScore]: ...


# -- turning scores into rows the way every suite needs ----------------------------------------


def close_scores(
    task: Task, earned: Mapping[str, SubtaskScore], outcome: Outcome
) -> list[SubtaskScore]:
    """One score per declared sub-task, in declaration order: the earned ones as they are,
    the rest 0 with the outcome's status (``unfinished`` when the run itself finished)."""
    status = "unfinished" if outcome.status == "finished" else outcome.status
    reason = outcome.reason or "session ended before this sub-task"
    out = []
    for s in task.subtasks:
        got = earned.get(s.subtask_id)
        out.append(
            got
            if got is not None
            else SubtaskScore(s.subtask_id, 0.0, s.weight, None, status, reason)
        )
    return out


# -- loading and validation --------------------------------------------------------------------


def _p(key: str, value: str, msg: str) -> str:
    """A problem, prefixed with the setting and its value unless ``key`` is empty."""
    return f"{key}={value!r}: {msg}" if key else msg


def _resolve(path: str, what: str, key: str) -> tuple[Any, list[str]]:
    """Import ``module:attr`` (or ``module.attr``); (object, problems)."""
    mod_name, sep, attr = path.partition(":")
    if not sep:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        return None, [
            _p(
                key,
                path,
                f"not a dotted path; write 'package.module:{what}' "
                f"(or a built-in name: {', '.join(BUILTIN_SUITES)})",
            )
        ]
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        return None, [
            _p(
                key,
                path,
                f"module {mod_name!r} not found ({exc}); check the spelling and that the "
                "package is installed or on PYTHONPATH",
            )
        ]
    except Exception as exc:  # the user's module raised on import
        return None, [_p(key, path, f"importing {mod_name!r} failed: {type(exc).__name__}: {exc}")]
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_"))
            return None, [
                _p(
                    key,
                    path,
                    f"{mod_name!r} has no attribute {attr!r}; "
                    f"it defines: {', '.join(names[:20]) or 'nothing public'}",
                )
            ]
        obj = getattr(obj, part)
    return obj, []


def _options_for(factory: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return dict(options)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in params}


def _shape_problems(obj: Any, key: str, path: str) -> list[str]:
    problems = []
    for m in SUITE_METHODS:
        if not callable(getattr(obj, m, None)):
            problems.append(
                _p(
                    key,
                    path,
                    f"the suite has no method {m}() (a suite needs task(seed), "
                    "start(task, workdir) and evaluate(env, outcome); see tasks/env/suite.py)",
                )
            )
    if not isinstance(getattr(obj, "name", None), str):
        problems.append(_p(key, path, "the suite needs a string attribute 'name'"))
    return problems


def load_suite(path: str, *, key: str = "rollout.suite", **options: Any) -> Suite:
    """The suite named by ``path`` (a built-in short name or ``module:attr``), built with the
    options it accepts; raises ``SuiteError`` with every problem found."""
    path = BUILTIN_SUITES.get(path, path)
    obj, problems = _resolve(path, "MySuite", key)
    if problems:
        raise SuiteError(problems)
    if inspect.isclass(obj) or (callable(obj) and not all(hasattr(obj, m) for m in SUITE_METHODS)):
        try:
            obj = obj(**_options_for(obj, options))
        except SuiteError as exc:
            raise SuiteError([_p(key, path, p) for p in exc.problems]) from exc
        except Exception as exc:
            raise SuiteError(
                [_p(key, path, f"building the suite failed: {type(exc).__name__}: {exc}")]
            ) from exc
    problems = _shape_problems(obj, key, path)
    if problems:
        raise SuiteError(problems)
    return obj


def check_env(env: Any) -> list[str]:
    """Problems with an environment returned by ``start`` (checked once per run)."""
    problems = [f"start() returned an env without {a!r}" for a in ENV_ATTRS if not hasattr(env, a)]
    problems += [
        f"start() returned an env without method {m}()"
        for m in ENV_METHODS
        if not callable(getattr(env, m, None))
    ]
    return problems


def check_task(task: Any) -> list[str]:
    if not isinstance(task, Task):
        return [f"task(seed) returned {type(task).__name__}, not tasks.env.suite.Task"]
    problems = []
    if not task.subtasks:
        problems.append("task(seed) returned a task without sub-tasks")
    ids = [s.subtask_id for s in task.subtasks]
    if len(set(ids)) != len(ids):
        problems.append(f"task(seed) returned duplicate sub-task ids: {ids}")
    return problems


def parse_harness(spec: str, *, key: str = "rollout.harness") -> tuple[str, Any, list[str]]:
    """``builtin`` | ``module:callable`` | ``cmd:...`` -> (kind, target, problems)."""
    if spec == "builtin":
        return "builtin", None, []
    if spec.startswith("cmd:"):
        try:
            argv = shlex.split(spec[4:])
        except ValueError as exc:
            return "cmd", None, [_p(key, spec, f"cannot split the command: {exc}")]
        if not argv:
            return "cmd", None, [_p(key, spec, "empty command; write 'cmd:python my_agent.py'")]
        exe = argv[0]
        if shutil.which(exe) is None and not Path(exe).is_file():
            return "cmd", None, [_p(key, spec, f"{exe!r} is not an executable on PATH or a file")]
        # the command runs in its session's workdir: relative paths to files that exist here
        # (the agent script, its config) are made absolute now
        argv = [
            os.path.abspath(a) if not os.path.isabs(a) and os.path.isfile(a) else a for a in argv
        ]
        return "cmd", argv, []
    obj, problems = _resolve(spec, "my_harness", key)
    if problems:
        problems[0] += "; or use 'builtin' or 'cmd:COMMAND'"
        return "callable", None, problems
    if not callable(obj):
        return "callable", None, [_p(key, spec, f"{type(obj).__name__} is not callable")]
    return "callable", obj, []


def check_suite(suite: str, options: Mapping[str, Any], *, key: str = "rollout.suite") -> list[str]:
    """Every problem with a suite path: import, shape, and one task and environment built
    from seed 0 (cheap for the bundled suites). ``key=""`` leaves the setting out."""
    try:
        s = load_suite(suite, key=key, **options)
    except SuiteError as exc:
        return exc.problems
    return [_p(key, suite, p) for p in _try_one(s)]


def check_harness(harness: str, *, key: str = "rollout.harness") -> list[str]:
    return parse_harness(harness, key=key)[2]


def _try_one(suite: Suite) -> list[str]:
    """Build task 0 and one environment for it in a scratch directory, then close it."""
    try:
        task = suite.task(0)
    except Exception as exc:
        return [f"task(0) raised {type(exc).__name__}: {exc}"]
    problems = check_task(task)
    if problems:
        return problems
    with tempfile.TemporaryDirectory(prefix="gyre-suite-check-") as tmp:
        try:
            env = suite.start(task, tmp)
        except Exception as exc:
            return [f"start(task, workdir) raised {type(exc).__name__}: {exc}"]
        problems = check_env(env)
        close = getattr(env, "close", None)
        if callable(close):
            close()
    return problems
