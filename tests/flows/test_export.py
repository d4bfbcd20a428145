"""`gyre export`: one flat row per branch, loadable by Hugging Face `datasets`, and exact:
each row is a real call's context + output, masked on the policy's tokens, with the
group-normalised advantage written here from its definition."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from storage.store import Store
from storage.tito import reconstruct_inputs
from tasks.handles import SessionHandle
from tasks.process import process_sessions
from tasks.trajectory.synth import random_session

GYRE = [sys.executable, "-m", "flows.cli"]


def _request(r) -> str:
    """A chat call's request as the gateway stores it: the messages it added since the call
    it extends (here its token parent; each adds one message naming itself)."""
    after = {"after": r.parent_request_id} if r.parent_request_id else {}
    return json.dumps({**after, "messages": [{"role": "user", "content": r.request_id}]})


@pytest.fixture()
def run_store(tmp_path):
    store = Store(str(tmp_path / "store"))
    rng = np.random.default_rng(7)
    records, sessions, scores = [], [], []
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.0}
    for sid, r in rewards.items():
        recs, _ = random_session(rng, n_calls=6, session_id=sid, p_dup=0.0)
        recs = [replace(r, request_json=_request(r)) for r in recs]
        records += recs
        sessions.append(SessionHandle(sid, "g0", "t", step=0, status="finished", subtasks={"x": 1}))
        scores.append(
            {"run_id": "run", "session_id": sid, "subtask_id": "x", "score": r, "weight": 1.0,
             "at_request_id": recs[-1].request_id, "source": "env", "status": "finished",
             "reason": ""}
        )  # fmt: skip
    store.append("tito", [r.to_row() for r in records])
    store.append("scores", scores)
    process_sessions(store, "run", 0, sessions, current_version=0)
    return store, records, rewards


def test_export_rows_are_real_branches_with_textbook_advantages(run_store, tmp_path):
    import datasets

    store, records, rewards = run_store
    out = tmp_path / "run.parquet"
    res = subprocess.run(
        [*GYRE, "export", "run", "--store", store.url, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    ds = datasets.load_dataset("parquet", data_files=str(out))["train"]
    assert len(ds) > len(rewards)  # sessions branch (retries, resets)

    full = reconstruct_inputs(records)
    by_id = {r.request_id: r for r in records}
    r = np.array(list(rewards.values()))
    grpo = {s: (v - r.mean()) / (r.std() + 1e-6) for s, v in rewards.items()}  # textbook
    for row in ds:
        leaf = by_id[row["request_id"]]
        context = np.concatenate([full[leaf.request_id], leaf.output_ids])
        seq = row["prompt_ids"] + row["response_ids"]
        assert seq == context[: len(seq)].tolist()  # a real call's tokens, as recorded
        # the leaf's own output ends the branch and is all policy tokens
        n_out = len(leaf.output_ids)
        assert len(seq) == len(context) and row["response_mask"][-n_out:] == [1] * n_out
        assert row["prompt_ids"] and len(row["response_ids"]) == len(row["response_mask"])
        # the policy's tokens, from the definition: outputs of the session's calls whose
        # context + output is a prefix of this branch, at the positions they were generated
        policy = np.zeros(len(context), bool)
        for rec in records:
            if rec.session_id != leaf.session_id:
                continue
            start = len(full[rec.request_id])
            own = np.concatenate([full[rec.request_id], rec.output_ids])
            if len(own) <= len(context) and (context[: len(own)] == own).all():
                policy[start : len(own)] = True
        n_prompt = len(row["prompt_ids"])
        assert not policy[:n_prompt].any()
        assert row["response_mask"] == policy[n_prompt:].astype(int).tolist()
        masked = [
            lp for lp, m in zip(row["behaviour_logprobs"], row["response_mask"], strict=True) if m
        ]
        assert all(lp <= 0 for lp in masked)
        assert row["reward"] == rewards[row["session_id"]]
        assert row["advantage"] == pytest.approx(grpo[row["session_id"]], abs=1e-9)
        # the harness's whole message list of the call that ends the branch
        chain, cur = [], leaf
        while cur is not None:
            chain.append(cur.request_id)
            cur = by_id.get(cur.parent_request_id)
        sent = [{"role": "user", "content": rid} for rid in reversed(chain)]
        assert json.loads(row["request_json"]) == {"messages": sent}


def test_export_of_an_unknown_run_is_a_clear_error(run_store, tmp_path):
    store, _, _ = run_store
    res = subprocess.run(
        [*GYRE, "export", "nope", "--store", store.url, "--out", str(tmp_path / "x.parquet")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "no rollouts of run 'nope'" in res.stderr
