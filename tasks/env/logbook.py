"""The ``logbook`` suite: a long-horizon session over a large generated service log.

Made for rollouts of hundreds of model calls and 100K+ tokens (``--preset long``, issue 24).
A task is a service log of ``subtasks`` pages (each ``LINES[difficulty]`` request lines,
~570 tiny-model tokens at the default level), generated from the task's seed::

    0042 10:03:41 web-3 GET /api/orders/4821 req=r7f3a status=503 ms=127

One user turn per page: the turn shows the page and asks one question about a request,
either on that page or on an earlier one (``BACK`` pages back at most), so later answers
need the whole context (or the tools). Every turn is a sub-task (weight 1), scored where
its answer was given (``at_request_id`` = the reply's request id), best of its attempts:

- 1.0 for the exact status code (the first number in the reply);
- otherwise the fraction of digit positions that match (``tools.answer_score``:
  ``"500"`` for ``503``: 2/3), 0 without a number; unanswered turns 0 (``close_scores``).

Tools (for an agent that wants to page back rather than remember): ``read_page(n)`` returns
page ``n`` (1-based, only pages already shown), ``grep(pattern)`` the shown lines that
contain ``pattern`` (a plain substring, at most ``GREP_MAX`` lines). Both outputs are as
large as a page, so a session that uses them grows as fast as one that does not.

Why this shape: the built-in harness makes one call per turn when the model answers without
a tool (a random-weights model almost always does), ``max_tool_rounds`` more when it calls
tools, and keeps the whole history (no summarising unless asked): ``subtasks=200`` turns
give >= 200 calls on one path, and the pages alone give ~100K tokens, with model outputs as
short as ``max_new_tokens``. Everything is a pure function of the seed.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from tasks.env.suite import Outcome, SubtaskScore, SubtaskSpec, Task, Turn, close_scores
from tasks.env.tools import BestAttempt, answer_score

SYSTEM_PROMPT = (
    "You are reading a service log, one page per message. Answer each question with the "
    "status code only. Tools: read_page(n) shows an earlier page again, grep(pattern) "
    "finds log lines."
)

LINES = {0: 4, 1: 10, 2: 20}  # difficulty -> log lines per page (1: ~570 tokens)
BACK = 8  # a question asks about this many pages back at most
GREP_MAX = 12
MAX_TOOL_ROUNDS = 2

HOSTS = ("web-1", "web-2", "web-3", "api-1", "api-2", "db-1", "cache-1", "queue-1")
METHODS = ("GET", "GET", "GET", "POST", "PUT", "DELETE")
PATHS = ("orders", "users", "items", "carts", "invoices", "sessions", "reports", "search")
STATUSES = (200, 200, 200, 201, 204, 301, 304, 400, 401, 403, 404, 409, 429, 500, 502, 503)


def _tool(name: str, description: str, arg: str, kind: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": kind}},
                "required": [arg],
            },
        },
    }


TOOL_SCHEMAS = [
    _tool("read_page", "Show page n of the log again (1-based).", "n", "integer"),
    _tool("grep", "Log lines (of the pages shown) that contain a string.", "pattern", "string"),
]


@dataclass(frozen=True)
class Question:
    subtask_id: str
    page: int  # 0-based page the question is asked with
    about: int  # 0-based page holding the answer (<= page)
    req: str
    answer: str


@dataclass(frozen=True)
class Log:
    pages: tuple[tuple[str, ...], ...]  # page -> its lines
    questions: tuple[Question, ...]

    def page_text(self, i: int) -> str:
        return "\n".join(self.pages[i])


def make_log(seed: int, n_pages: int, difficulty: int = 1) -> Log:
    """``n_pages`` pages of ``LINES[difficulty]`` lines and one question per page, from
    ``seed`` alone; request ids are unique within the log."""
    rng = random.Random(seed)
    per = LINES[difficulty]
    seen: set[str] = set()
    pages, status_of = [], {}
    t = rng.randrange(0, 3600)
    for p in range(n_pages):
        lines = []
        for j in range(per):
            req = f"r{rng.getrandbits(20):05x}"
            while req in seen:
                req = f"r{rng.getrandbits(20):05x}"
            seen.add(req)
            t += rng.randint(1, 9)
            status = rng.choice(STATUSES)
            status_of[req] = (p, status)
            lines.append(
                f"{p * per + j + 1:05d} {t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d} "
                f"{rng.choice(HOSTS)} {rng.choice(METHODS)} /api/{rng.choice(PATHS)}/"
                f"{rng.randint(1, 9999)} req={req} status={status} ms={rng.randint(1, 2000)}"
            )
        pages.append(tuple(lines))
    questions = []
    for p in range(n_pages):
        about = rng.randint(max(0, p - BACK), p)
        line = rng.choice(pages[about])
        req = line.split("req=")[1].split()[0]
        questions.append(Question(f"q{p}", p, about, req, str(status_of[req][1])))
    return Log(tuple(pages), tuple(questions))


def turn_prompt(log: Log, q: Question) -> str:
    n = len(log.pages)
    return (
        f"Log page {q.page + 1} of {n}:\n{log.page_text(q.page)}\n"
        f"Question: what is the status of request {q.req}?"
    )


@dataclass
class LogbookEnv:
    """One session: the log, the pages shown so far, the best answer to each question."""

    task: Task
    log: Log
    workdir: str = ""
    system_prompt: str = SYSTEM_PROMPT
    max_tool_rounds: int = MAX_TOOL_ROUNDS
    results: dict[str, BestAttempt] = field(default_factory=dict)
    shown: int = 0  # pages the session has been shown (turns started)
    tool_calls: int = 0

    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOL_SCHEMAS

    @property
    def turns(self) -> list[Turn]:
        return [Turn(q.subtask_id, turn_prompt(self.log, q)) for q in self.log.questions]

    def _see(self, turn_id: str) -> Question:
        q = self.log.questions[int(turn_id.removeprefix("q"))]
        self.shown = max(self.shown, q.page + 1)
        return q

    def call_tool(
        self, turn_id: str, name: str, arguments: dict[str, Any], request_id: str | None = None
    ) -> str:
        """``read_page`` / ``grep`` over the pages shown up to ``turn_id``'s page."""
        self._see(turn_id)
        self.tool_calls += 1
        if name == "read_page":
            try:
                n = int(arguments.get("n", 0))
            except (TypeError, ValueError):
                return f"error: n must be a page number 1..{self.shown}"
            if not 1 <= n <= self.shown:
                return f"error: page {n} not shown yet; pages 1..{self.shown}"
            return f"Log page {n} of {len(self.log.pages)}:\n{self.log.page_text(n - 1)}"
        if name == "grep":
            pattern = str(arguments.get("pattern", ""))
            if not pattern:
                return "error: empty pattern"
            hits = [ln for p in self.log.pages[: self.shown] for ln in p if pattern in ln]
            more = f"\n({len(hits) - GREP_MAX} more lines)" if len(hits) > GREP_MAX else ""
            return ("\n".join(hits[:GREP_MAX]) or "no match") + more
        return f"error: no tool {name!r}; use read_page or grep"

    def submit(self, turn_id: str, text: str, request_id: str | None = None) -> float:
        """Grade one answer; the best attempt per question counts, credited to its reply."""
        q = self._see(turn_id)
        score = answer_score(text, q.answer)
        res = self.results.setdefault(turn_id, BestAttempt())
        res.attempts += 1
        if score > res.score:
            res.score, res.at_request_id = score, request_id
        return score

    def progress(self) -> str:
        right = sum(r.score == 1.0 for r in self.results.values())
        return (
            f"{self.shown} of {len(self.log.pages)} pages read, "
            f"{len(self.results)} questions answered ({right} exactly)."
        )

    def close(self) -> None:
        pass


class LogbookSuite:
    """Logs from seeds (``subtasks`` pages, one question each), graded as answered."""

    name = "logbook"

    def __init__(self, subtasks: int = 200, difficulty: int = 1):
        if difficulty not in LINES:
            raise ValueError(f"difficulty={difficulty}: the logbook suite has levels {list(LINES)}")
        if subtasks < 1:
            raise ValueError(f"subtasks={subtasks}: the logbook needs at least one page")
        self.subtasks, self.difficulty = subtasks, difficulty

    def task(self, seed: int) -> Task:
        log = make_log(seed, self.subtasks, self.difficulty)
        return Task(
            f"logbook-d{self.difficulty}-{seed}",
            seed,
            tuple(
                SubtaskSpec(q.subtask_id, 1.0, f"status of {q.req} (page {q.about + 1})")
                for q in log.questions
            ),
            {"pages": len(log.pages), "difficulty": self.difficulty},
        )

    def start(self, task: Task, workdir: str) -> LogbookEnv:
        return LogbookEnv(task, make_log(task.seed, len(task.subtasks), self.difficulty), workdir)

    def evaluate(self, env: LogbookEnv, outcome: Outcome) -> list[SubtaskScore]:
        earned = {
            sid: SubtaskScore(sid, r.score, 1.0, r.at_request_id, "finished", "", "env")
            for sid, r in env.results.items()
        }
        return close_scores(env.task, earned, outcome)
