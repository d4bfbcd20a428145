"""Every suite through the real gateway and the embedded engine, via the rollout body.

The engine is the tiny random model, so unscripted sessions score low; scripted sessions
(teacher-forced replies, see tests/infra/gateway/fixtures.py) play a correct agent, so the
whole path - tool calls parsed by the gateway, tool results fed back, evaluation, scores in
the store attached to recorded calls - is checked end to end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.store import Store
from storage.tito_log import table_to_records
from tasks.env.config import RolloutConfig
from tasks.env.harness import run_agent
from tasks.env.repo import load_specs
from tasks.env.suite import HarnessContext, HarnessSettings, load_suite
from tasks.env.tools import ToolsSuite
from tasks.handles import GroupSpec
from tasks.process import process_sessions
from tasks.rollout import new_session, roll_out_group
from tasks.trajectory.tree import build_trees
from tests.infra.gateway.fixtures import ScriptedEngine

pytestmark = pytest.mark.integration

ADMIN = "admin-env"
FAKE = "tests.tasks.env.fake_suites"
RUN = "run-env"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    model_dir = make_tiny_model()
    engine = ScriptedEngine(model_dir, cell_id="a")
    server = EngineServer(engine)
    url = server.start()
    gw = Gateway(
        Store(str(root / "store")),
        run_id=RUN,
        tokenizer_dir=model_dir,
        spool_dir=str(root / "spool"),
        admin_token=ADMIN,
    )
    gw.add_engine("a", url)
    gw.start()
    yield gw, engine
    gw.stop()
    server.stop()
    engine.close()


def _roll(gw, cfg: RolloutConfig, seed: int, group: str):
    spec = GroupSpec(index=0, group_id=group, task_seed=seed, subtasks=cfg.subtasks)
    handles = roll_out_group(gw.url, ADMIN, gw.store, RUN, spec, cfg)
    gw.flush()
    sids = {h.session_id for h in handles}
    scores = [r for r in gw.store.read("scores").to_pylist() if r["session_id"] in sids]
    records = [r for r in table_to_records(gw.store.read("tito")) if r.session_id in sids]
    return handles, scores, records


def _script(gw, engine, replies: list[str]) -> None:
    engine.replies.clear()
    engine.replies.extend(gw.tok.encode(r) for r in replies)


def _call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_arith_and_tools_with_the_random_model(served):
    gw, engine = served
    engine.replies.clear()
    for suite, extra in (("arith", {}), ("tools", {"difficulty": 1})):
        cfg = RolloutConfig(suite=suite, group_size=2, subtasks=2, max_new_tokens=12, **extra)
        handles, scores, records = _roll(gw, cfg, 7, f"g-{suite}")
        assert [h.status for h in handles] == ["finished", "finished"]
        assert len(scores) == 4 and all(0.0 <= s["score"] <= 1.0 for s in scores)
        assert {s["status"] for s in scores} <= {"finished", "unfinished"}
        assert handles[0].subtasks == {"s0": 1.0, "s1": 1.0} if suite == "arith" else True
        rids = {r.request_id for r in records}
        assert all(s["at_request_id"] in rids for s in scores if s["at_request_id"])
        assert sum(h.calls for h in handles) == len(records) >= 4


def test_tools_scripted_agent_scores_full_marks(served):
    gw, engine = served
    seed = 11
    cfg = RolloutConfig(suite="tools", difficulty=3, group_size=1, subtasks=3, max_new_tokens=48)
    env = ToolsSuite(subtasks=3, difficulty=3).start(ToolsSuite(3, 3).task(seed), "")
    replies = []
    for q in env.questions:
        replies += [_call(tool, box=box) for tool, box in q.calls] + [q.answer]
    _script(gw, engine, replies)
    handles, scores, records = _roll(gw, cfg, seed, "g-tools-scripted")
    assert not engine.replies  # every scripted reply was asked for
    assert [s["score"] for s in scores] == [1.0, 1.0, 1.0]
    assert {s["status"] for s in scores} == {"finished"}
    assert handles[0].calls == len(replies) == len(records)
    answer_calls = {r.request_id for r in records if gw.tok.decode(r.output_ids).isdigit()}
    assert {s["at_request_id"] for s in scores} <= answer_calls
    # tool results went back as tool messages: the answer calls' inputs hold them
    # every session scores 1: a group with no learning signal, kept here to check the tree
    out = process_sessions(gw.store, RUN, 0, handles, current_version=0, filter_zero_variance=False)
    assert out.reward_mean == 1.0 and out.n_samples == 1 and out.zero_variance_groups == 1


@pytest.mark.slow  # ~15 s: 1,500 teacher-forced tokens and two sandboxed pytest runs
def test_repo_scripted_agent_builds_the_package(served):
    gw, engine = served
    suite = load_suite("repo")
    seed = next(s for s in range(100) if suite.task(s).data["spec"] == "stack")
    spec = load_specs()["stack"]
    writes = "\n".join(_call("write_file", path=p, content=c) for p, c in spec.solution().items())
    _script(gw, engine, [writes, _call("run_tests"), "DONE"])
    cfg = RolloutConfig(suite="repo", group_size=1, max_new_tokens=1500)
    handles, scores, records = _roll(gw, cfg, seed, "g-repo-scripted")
    assert not engine.replies and handles[0].status == "finished" and len(records) == 3
    assert [(s["subtask_id"], s["score"], s["status"]) for s in scores] == [
        ("push_pop", 1.0, "finished"),
        ("limits", 1.0, "finished"),
        ("inspect", 1.0, "finished"),
    ]
    first = min(records, key=lambda r: r.seq_no)
    assert {s["at_request_id"] for s in scores} == {first.request_id}  # earned by the writes
    assert {s["source"] for s in scores} == {"evaluator"}
    # the run_tests result reached the model as a tool message
    assert "passed" in gw.tok.decode(max(records, key=lambda r: r.seq_no).new_input_ids)


def test_repo_with_the_random_model_scores_zero_with_a_reason(served):
    gw, engine = served
    engine.replies.clear()
    cfg = RolloutConfig(suite="repo", group_size=1, max_new_tokens=16, max_tool_rounds=2)
    handles, scores, _ = _roll(gw, cfg, 0, "g-repo-random")
    assert handles[0].status == "finished"
    assert {(s["score"], s["status"]) for s in scores} == {(0.0, "unfinished")}
    assert all("hidden tests pass" in s["reason"] or "no package" in s["reason"] for s in scores)


def test_context_budget_compacts_into_branches(served):
    gw, engine = served
    engine.replies.clear()
    suite = ToolsSuite(subtasks=3, difficulty=0)
    env = suite.start(suite.task(2), "")
    sid, key = new_session(gw.url, ADMIN, "g-ctx", {})
    settings = HarnessSettings(max_tokens=8, max_attempts=1, context_tokens=1)
    res = _run(run_agent(HarnessContext(gw.url, key, env, settings)))
    gw.flush()
    assert res.compactions >= 2
    records = [r for r in table_to_records(gw.store.read("tito")) if r.session_id == sid]
    tree = build_trees(records)[sid]
    branch_points = [row for row in tree.node_rows(RUN, {}) if row["n_children"] > 1]
    assert branch_points  # each compaction started a new branch off the shared system prompt


def test_a_session_past_its_time_is_scored_as_timed_out(served):
    gw, engine = served
    engine.replies.clear()
    slow = RolloutConfig(
        suite=f"{FAKE}:EchoSuite", harness=f"{FAKE}:sleepy", timeout_s=1.0, group_size=1
    )
    handles, scores, _ = _roll(gw, slow, 1, "g-timeout")
    assert handles[0].status == "timeout"
    assert {(s["score"], s["status"], s["reason"]) for s in scores} == {
        (0.0, "timeout", "rollout exceeded 1.0s")
    }


@pytest.mark.slow  # ~6 s: two Python processes importing openai
def test_command_harness_uses_the_openai_client_from_env_vars(served):
    gw, engine = served
    engine.replies.clear()
    agent = Path(__file__).with_name("echo_agent.py")
    cmd = RolloutConfig(
        suite=f"{FAKE}:EchoSuite",
        harness=f"cmd:{sys.executable} {agent}",
        group_size=2,
        subtasks=2,
    )
    handles, scores, records = _roll(gw, cmd, 3, "g-cmd")
    assert [h.status for h in handles] == ["finished", "finished"]
    assert [s["score"] for s in scores] == [1.0] * 4  # 2 sessions x 2 words
    assert {s["at_request_id"] for s in scores} == {r.request_id for r in records}
    assert len(records) == 4  # the agent's own calls, recorded under its session keys


def _run(coro):
    import asyncio

    return asyncio.run(coro)
