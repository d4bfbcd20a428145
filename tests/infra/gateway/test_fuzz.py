"""Property-based fuzzing of the gateway's JSON endpoints (hypothesis; slow).

Bodies mix well-formed values with arbitrary JSON in every field (and raw bytes that are not
JSON at all), sent to chat, completions, responses, native ``/generate`` and scores, streamed
or not, to a gateway whose chat template shows tools and to one whose template does not
(SmolLM2's). Properties: never a 5xx or a dropped connection; every 4xx in OpenAI's error shape;
and what is stored is right: every answered call is in the TITO log exactly once, each record's
input rebuilds to what the engine received, and each session's ``seq_no`` has no gap.
"""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.store import Store
from storage.tito import reconstruct_inputs
from storage.tito_log import table_to_records
from tests.infra.gateway.fixtures import SMOL_TEMPLATE, ScriptedEngine, tokenizer_with_template

pytestmark = [pytest.mark.integration, pytest.mark.slow]

leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
anything = st.recursive(
    leaf,
    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=6), ch, max_size=3),
    max_leaves=8,
)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value, sometimes anything at all."""
    return st.one_of(valid, valid, valid, anything)


small_int = st.integers(-1, 4) | st.sampled_from([10**9, 2**64])
prob = st.floats(-0.5, 2.5)
stop = st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3)
tool_call = st.fixed_dictionaries(
    {"id": field(st.text(max_size=6)), "type": field(st.just("function")),
     "function": field(st.fixed_dictionaries({"name": field(st.text(max_size=5)),
                                               "arguments": field(st.text(max_size=10))}))}
)  # fmt: skip
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "assistant", "system", "tool", "developer"])),
     "content": field(st.text(max_size=20) | st.none())},
    optional={"tool_calls": field(st.lists(tool_call, max_size=2)),
              "tool_call_id": field(st.text(max_size=5))},
)  # fmt: skip
tool = st.fixed_dictionaries(
    {"type": field(st.just("function")),
     "function": field(st.fixed_dictionaries({"name": field(st.text(min_size=1, max_size=5)),
                                               "parameters": field(st.just({}))}))}
)  # fmt: skip
sampling = {
    "max_tokens": field(small_int),
    "temperature": field(prob),
    "top_p": field(prob),
    "seed": field(st.integers(-(2**64), 2**64)),
    "stop": field(stop),
    "stream": field(st.booleans()),
    "n": field(small_int),
}
chat = st.fixed_dictionaries(
    {"model": field(st.just("gyre")), "messages": field(st.lists(message, min_size=1, max_size=3))},
    optional={**sampling, "tools": field(st.lists(tool, max_size=2)),
              "tool_choice": field(st.sampled_from(["auto", "none"])),
              "logprobs": field(st.booleans()), "top_logprobs": field(small_int),
              "stream_options": field(st.fixed_dictionaries({"include_usage": field(st.booleans())}))},
)  # fmt: skip
ids = st.lists(
    st.integers(-5, 1200) | st.sampled_from([2**31, 2**63, 2**70, -(2**64)]), max_size=12
)
completion = st.fixed_dictionaries(
    {"model": field(st.just("gyre")),
     "prompt": field(st.text(max_size=20) | ids | st.lists(st.text(max_size=5), max_size=2))},
    optional={**sampling, "logprobs": field(small_int)},
)  # fmt: skip
generate = st.fixed_dictionaries(
    {},
    optional={"input_ids": field(ids), "text": field(st.text(max_size=20)),
              "stream": field(st.booleans()), "return_logprob": field(st.booleans()),
              "sampling_params": field(st.fixed_dictionaries({}, optional={
                  "max_new_tokens": field(small_int), "temperature": field(prob),
                  "top_p": field(prob), "top_k": field(small_int), "stop": field(stop),
                  "stop_token_ids": field(ids), "sampling_seed": field(small_int)}))},
)  # fmt: skip
item = st.one_of(
    st.fixed_dictionaries({"type": field(st.just("message")), "role": field(st.sampled_from(["user", "assistant", "developer"])),
                           "content": field(st.text(max_size=10))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": field(st.text(max_size=4)),
                           "name": field(st.text(max_size=4)), "arguments": field(st.text(max_size=6))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": field(st.text(max_size=4)),
                           "output": field(st.text(max_size=6))}),
)  # fmt: skip
responses = st.fixed_dictionaries(
    {"model": field(st.just("gyre")), "input": field(st.text(min_size=1, max_size=15) | st.lists(item, max_size=3))},
    optional={"instructions": field(st.text(max_size=10)), "max_output_tokens": field(small_int),
              "temperature": field(prob), "stream": field(st.booleans()),
              "previous_response_id": field(st.text(max_size=6)),
              "tools": field(st.lists(st.fixed_dictionaries({"type": field(st.just("function")),
                                                             "name": field(st.text(min_size=1, max_size=4))}), max_size=1))},
)  # fmt: skip
score = st.fixed_dictionaries(
    {"subtask_id": field(st.text(max_size=5)), "score": field(st.floats(-1, 2))},
    optional={"weight": field(st.floats(-1, 3)), "at_request_id": field(st.text(max_size=5))},
)  # fmt: skip
PATHS = {
    "/v1/chat/completions": chat,
    "/v1/completions": completion,
    "/v1/responses": responses,
    "/generate": generate,
    "/gyre/scores": score | st.fixed_dictionaries({"scores": field(st.lists(score, max_size=2))}),
}
request = st.sampled_from(sorted(PATHS)).flatmap(
    lambda p: st.tuples(
        st.just(p),
        PATHS[p].map(lambda b: json.dumps(b).encode()) | st.binary(max_size=30),
        st.integers(0, 2),
    )
)


@pytest.fixture(scope="module", params=["tiny", "smol-style"])
def served(request, tmp_path_factory):
    """The tiny model behind its own template (tools shown by the template) or behind a copy of
    SmolLM2's (tools, tool calls and content parts rewritten by the gateway)."""
    model = make_tiny_model()
    eng = ScriptedEngine(model, cell_id="a")
    srv = EngineServer(eng)
    url = srv.start()
    tmp = tmp_path_factory.mktemp("fuzz")
    tok_dir = (
        model if request.param == "tiny" else tokenizer_with_template(tmp / "tok", SMOL_TEMPLATE)
    )
    gw = Gateway(
        Store(str(tmp / "store")),
        run_id="fuzz",
        tokenizer_dir=tok_dir,
        spool_dir=str(tmp / "spool"),
        default_max_tokens=4,
    )
    gw.add_engine("a", url)
    gw.start()
    keys = [gw.new_session()[1] for _ in range(3)]
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        yield gw, eng, keys, http
    gw.stop()
    srv.stop()
    eng.close()


def test_fuzzed_bodies_never_5xx_and_store_only_right_records(served):
    gw, eng, keys, http = served
    answered: dict[str, set[str]] = defaultdict(set)  # session key -> ids of answered calls

    @settings(
        max_examples=250,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(request)
    def one(req):
        path, body, k = req
        r = http.post(path, content=body, headers={"Authorization": f"Bearer {keys[k]}"})
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            return
        if path == "/gyre/scores":
            return
        if r.headers["content-type"].startswith("text/event-stream"):
            datas = [
                json.loads(line[6:])
                for line in r.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            last = datas[-1]
            if "error" in last or last.get("type") == "error":
                return
            rid = last.get("id") or last.get("response", {}).get("id")
            rid = rid or last["meta_info"]["id"]
        else:
            got = r.json()
            rid = got["id"] if "id" in got else got["meta_info"]["id"]
        answered[keys[k]].add(rid)

    one()
    gw.flush()
    recs = table_to_records(gw.store.read("tito"))
    by_session = defaultdict(list)
    for rec in recs:
        by_session[rec.session_id].append(rec)
    key_of = {gw.sessions.by_key(k).session_id: k for k in keys}
    assert len({r.request_id for r in recs}) == len(recs)  # each call once
    for sid, rs in by_session.items():
        assert sorted(r.seq_no for r in rs) == list(range(len(rs)))  # no gap
        assert {r.request_id for r in rs} == answered[key_of[sid]]  # exactly the answered ones
    full = reconstruct_inputs(recs)
    for r in recs:
        assert full[r.request_id].tolist() == eng.received[r.request_id]
    assert gw.counters["calls"] == len(recs) > 0
