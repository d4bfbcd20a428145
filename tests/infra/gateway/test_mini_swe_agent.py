"""mini-swe-agent through litellm, unmodified, against the gateway: every record rebuilt from
TITO equals the ids the engine saw.

The agent is built as its own ``mini`` command builds it (its bundled ``mini.yaml``,
``get_model`` -> ``LitellmModel``, ``get_environment`` -> ``LocalEnvironment`` in a temporary
directory, ``get_agent`` -> ``DefaultAgent``), pointed at gyre by litellm's OpenAI provider
(``openai/<model>``, ``api_base`` = the gateway, ``api_key`` = the session key). It solves a
trivial task in three steps (write a file, read it back, submit) with the ``bash`` tool its
model declares: the engine's replies are scripted (teacher-forced, see `ScriptedEngine`) so a
random-weight model still calls the tool. The ids the engine saw are read from its own audit
log (``Engine(audit_path=)``, what ``model.audit_dir`` turns on in a run).

Default suite: the tiny random Llama behind its own template (tools in a tool section) and
behind SmolLM2's (no tool section: tools rewritten into the system prompt and parsed back).
Slow: the real SmolLM2-135M-Instruct (``gyre model prepare smollm2``, cached).

Nothing may reach the network: litellm's model-cost map and tokenizers come from its package
(``LITELLM_LOCAL_MODEL_COST_MAP``, ``LITELLM_OFFLINE_MODE``), and an audit hook refuses, and
records, any connection or name lookup beyond loopback while the agent runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.store import Store
from storage.tito import reconstruct_inputs
from tests.infra.gateway.fixtures import (
    SMOL_TEMPLATE,
    ScriptedEngine,
    exact_records,
    tokenizer_with_template,
)

pytestmark = pytest.mark.integration

TASK = "Create a file hello.txt that contains the word hello, then submit."
COMMANDS = ["echo hello > hello.txt", "cat hello.txt", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]


def _call(command: str) -> str:
    args = json.dumps({"command": command})
    return f'<tool_call>\n{{"name": "bash", "arguments": {args}}}\n</tool_call>'


# -- no network --------------------------------------------------------------------------------

_attempts: list[str] | None = None  # set while a `no_network()` block runs


def _is_local(host) -> bool:
    if host is None or host in ("localhost", ""):
        return True
    if isinstance(host, bytes):
        host = host.decode()
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


def _guard(event: str, args: tuple) -> None:
    if _attempts is None:
        return
    if event == "socket.connect":
        addr = args[1]
        host = addr[0] if isinstance(addr, tuple) else None  # AF_UNIX: a path, local
    elif event == "socket.getaddrinfo":
        host = args[0]
    else:
        return
    if not _is_local(host):
        _attempts.append(f"{event} {host}")
        raise OSError(f"no network in this test: {event} to {host!r}")


_hooked = False


@contextlib.contextmanager
def no_network():
    """Refuse (OSError) and record every connection or name lookup beyond loopback, in any
    thread, for the block's duration; yields the list of attempts."""
    global _attempts, _hooked
    if not _hooked:
        sys.addaudithook(_guard)  # audit hooks cannot be removed: it is idle outside blocks
        _hooked = True
    _attempts = []
    try:
        yield _attempts
    finally:
        _attempts = None


# -- the harness, as mini-swe-agent builds it --------------------------------------------------

OFFLINE = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # the packaged cost map, never fetched
    "LITELLM_OFFLINE_MODE": "true",  # nor catalogs or tokenizers
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_COST_TRACKING": "ignore_errors",  # a local model has no price
    # one try per call: a retried call would take the next call's scripted reply
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
}


@dataclass
class Mini:
    config: dict  # mini-swe-agent's bundled mini.yaml
    get_model: Callable
    get_environment: Callable
    get_agent: Callable
    attempts: list[str]  # network attempts refused so far (must stay empty)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """mini-swe-agent's builders, imported and run offline for the whole module: litellm reads
    its settings at import and mini-swe-agent its model class's defaults when ``get_model``
    first imports it, so the variables stay set (and the network guard on) until the end.
    Its global config directory, which it creates on import, is a temporary one."""
    missing = [m for m in ("litellm", "minisweagent") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not installed: pip install -e '.[dev]' (or make install)"
        )
    with pytest.MonkeyPatch.context() as mp, no_network() as attempts:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        mp.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path_factory.mktemp("mswea")))
        with warnings.catch_warnings():  # litellm's TypedDicts warn under pydantic 2.14
            warnings.simplefilter("ignore", UserWarning)
            from minisweagent.agents import get_agent
            from minisweagent.config import get_config_from_spec
            from minisweagent.environments import get_environment
            from minisweagent.models import get_model
        yield Mini(get_config_from_spec("mini.yaml"), get_model, get_environment, get_agent,
                   attempts)  # fmt: skip
    assert attempts == []


def run_agent(mini: Mini, gw: Gateway, key: str, workdir: Path, *, steps: int = 5):
    """mini-swe-agent's DefaultAgent on ``TASK`` in ``workdir``, talking to ``gw``: its exit
    info and messages."""
    config = mini.config
    model_cfg = dict(config["model"])
    model_cfg["model_kwargs"] = {
        **model_cfg.get("model_kwargs", {}),
        "api_base": gw.openai_base_url,
        "api_key": key,
        "temperature": 0.0,
        "max_tokens": 96,
        "timeout": 600,  # SmolLM2's prefill of the ~1,900-token prompt on a loaded machine
        "num_retries": 0,
    }
    model = mini.get_model("openai/gyre", model_cfg)
    env = mini.get_environment({**config["environment"], "cwd": str(workdir)}, default_type="local")
    agent_cfg = {**config["agent"], "step_limit": steps, "cost_limit": 0}
    agent = mini.get_agent(model, env, agent_cfg, default_type="default")
    assert type(agent).__name__ == "DefaultAgent" and type(model).__name__ == "LitellmModel"
    return agent.run(TASK), agent.messages


def _audited(path: Path) -> dict[str, list[int]]:
    rows = (json.loads(line) for line in path.read_text().splitlines())
    return {r["rid"]: r["input_ids"] for r in rows}


def check_agent_session(mini: Mini, gw: Gateway, eng, audit: Path, workdir: Path) -> None:
    sid, key = gw.new_session()
    for command in COMMANDS:
        eng.replies.append(gw.tok.encode(_call(command)))
    result, messages = run_agent(mini, gw, key, workdir)
    assert mini.attempts == []
    assert result["exit_status"] == "Submitted", messages[-1]
    assert (workdir / "hello.txt").read_text() == "hello\n"  # the local environment ran it
    tool_turns = [m for m in messages if m["role"] == "tool"]
    assert len(tool_turns) == 2 and '"output": "hello\\n"' in tool_turns[1]["content"]
    # three calls, each extending the one before; inputs rebuilt from TITO = the engine's
    # own record of what it was asked, outputs = what it generated
    recs = exact_records(gw, sid, eng)
    assert len(recs) == 3 and {r.endpoint for r in recs} == {"chat"}
    seen = _audited(audit)
    full = reconstruct_inputs(recs)
    for r in recs:
        assert full[r.request_id].tolist() == seen[r.request_id]
    # the tool was shown to the model and its calls are the policy's tokens
    assert '"name": "bash"' in gw.tok.decode(seen[recs[0].request_id])
    for r, command in zip(recs, COMMANDS, strict=True):
        assert json.dumps(command) in gw.tok.decode(list(r.output_ids))


def _serve(model_dir: str, tok_dir: str, root: Path):
    audit = root / "audit" / "a.jsonl"
    eng = ScriptedEngine(model_dir, cell_id="a", audit_path=str(audit))
    srv = EngineServer(eng)
    url = srv.start()
    gw = Gateway(
        Store(str(root / "store")),
        run_id="run-mini",
        tokenizer_dir=tok_dir,
        spool_dir=str(root / "spool"),
    )
    gw.add_engine("a", url)
    gw.start()
    return eng, srv, gw, audit


@contextlib.contextmanager
def serving(model_dir: str, tok_dir: str, root: Path):
    eng, srv, gw, audit = _serve(model_dir, tok_dir, root)
    try:
        yield eng, gw, audit
    finally:
        gw.stop()
        srv.stop()
        eng.close()


@pytest.mark.parametrize("template", ["own", "smollm2"])
def test_mini_swe_agent_on_a_tiny_llama(mini, template, tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", seed=0, arch="llama")
    tok_dir = (
        model_dir
        if template == "own"
        else tokenizer_with_template(tmp_path / "smol-tok", SMOL_TEMPLATE)
    )
    work = tmp_path / "work"
    work.mkdir()
    with serving(model_dir, tok_dir, tmp_path) as (eng, gw, audit):
        check_agent_session(mini, gw, eng, audit, work)
        if template == "smollm2":  # no tool section: the tools went into the system turn
            assert not gw.tok.shows.shows_tools


@pytest.mark.slow
def test_mini_swe_agent_on_smollm2(mini, tmp_path):
    from infra.engine import pretrained

    if why := pretrained.problem("smollm2"):
        pytest.skip(why)
    model_dir = pretrained.prepare("smollm2", say=lambda s: None)
    work = tmp_path / "work"
    work.mkdir()
    with serving(model_dir, model_dir, tmp_path) as (eng, gw, audit):
        check_agent_session(mini, gw, eng, audit, work)
    assert os.path.basename(model_dir) == "smollm2-135m-instruct"
