"""A tiny checkpoint made locally: random weights, a locally trained tokenizer.

Nothing here touches a network. `make_tiny_model()` writes a complete Hugging Face checkpoint
directory (config, safetensors weights, tokenizer with a Qwen-style chat template) that
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load offline. It is the
"baby" model of every test, demo and benchmark: ~100K parameters, deterministic per seed.
Qwen3 by default; ``arch="llama"`` (SmolLM2's architecture: no q/k norms, ``head_dim`` implied
by hidden / heads) and ``arch="qwen2"`` (q/k/v biases) make the same model in those families,
so that what the engine and trainer claim can be tested on each.

The chat template renders each message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, so the
rendering is prefix-stable: rendering ``messages[:k]`` is a text prefix of rendering
``messages[:k+1]`` (and ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``, a prefix of
the next assistant turn). The gateway relies on this for token exactness.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from storage.paths import cache_dir

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
TOOL_TOKENS = [TOOL_CALL_START, TOOL_CALL_END]

VOCAB_SIZE = 1024  # BPE target; special and tool tokens are part of it
_MARKER = ".gyre-complete"
FORMAT_VERSION = 2  # bump when the recipe changes: caches built by an older one are rebuilt

# Qwen-style, simplified. `tools` go into the system turn; assistant tool calls are rendered as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>; a tool result is its own turn.
# HF renders with trim_blocks: a newline right after a block tag is written as {{ nl }}.
CHAT_TEMPLATE = (
    "{% macro render_content(content) %}"
    "{% if content is none %}"
    "{% elif content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part is mapping and part.text is defined %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% set ns = namespace(start=0) %}"
    "{% set nl = '\\n' %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}"
    "{{ render_content(messages[0].content) }}\n\n{% set ns.start = 1 %}"
    "{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages[ns.start:] %}"
    "<|im_start|>{{ message.role }}\n"
    "{% set text = render_content(message.content) %}{{ text }}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "{% if not loop.first or text %}{{ nl }}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{% else %}{{ tool_call.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A small bundled corpus: chat/agent/code flavoured English, enough for ~1000 BPE merges.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
You are a helpful assistant. Please answer the question below and explain your reasoning.
The user asked for help with a Python function that parses a configuration file and returns
a dictionary. The assistant read the file, found the bug, and wrote a test that reproduces it.
def add(a, b):
    return a + b

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

import json
import os
from pathlib import Path

for i in range(10):
    print(i, i * i)
if value is None:
    raise ValueError("value must not be None")
{"name": "search", "arguments": {"query": "weather in Paris", "limit": 5}}
{"name": "read_file", "arguments": {"path": "src/main.py"}}
{"name": "run_tests", "arguments": {"pattern": "tests/unit"}}
The tests passed. The tests failed with an assertion error on line 42.
Error: file not found. Permission denied. Timeout after 30 seconds. Retrying the request.
Let me think step by step. First, list the files in the repository. Then open the module that
defines the function, read it carefully, and change only what is needed. Finally run the tests.
The answer is 42. The result is correct. The sum of 17 and 25 is 42. Two plus two equals four.
Reinforcement learning trains a policy to maximise reward. The agent observes the environment,
takes an action, and receives a reward. Long horizon tasks need many steps and many tool calls.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 256 1000 4096 65536.
Punctuation and symbols: ( ) [ ] { } < > = + - * / % , . ; : ! ? ' " # @ $ & | ^ ~ _ \\ `
git status; git diff; git commit -m "fix parser"; pytest -q; ls -la; cat README.md; grep -rn TODO
The weather today is sunny with a light breeze. Tomorrow it will rain in the afternoon.
Once upon a time there was a small robot who wanted to learn how to write programs.
It read many books, asked many questions, and slowly became very good at fixing bugs.
The scheduler moves cells between rollout and training while the run goes on. Each cell holds an
engine or a trainer replica. The gateway records every call token by token, and the processor
builds a tree of calls by shared prefix. Scores are attached to the node where they were earned.
Weights are published after every optimizer step, and rollout cells load them at boundaries.
She opened the window, looked at the garden, and decided to plant tomatoes, carrots and beans.
Mathematics: x = y * 2 + 3; f(x) = x ** 2 - 4 * x + 4; the derivative is 2 * x - 4; solve for x.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June
red orange yellow green blue indigo violet black white gray brown pink purple silver gold
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

async def fetch(client, url):
    response = await client.get(url, timeout=10.0)
    response.raise_for_status()
    return response.json()

SELECT id, name, count(*) FROM requests WHERE status = 'done' GROUP BY id, name ORDER BY 3 DESC;
<tool_response>{"temperature": 21, "unit": "celsius", "city": "Paris"}</tool_response>
Thank you! You're welcome. Could you please clarify what you mean? Sure, here is an example.
"""


ARCHS = ("qwen3", "llama", "qwen2")


DEFAULT_MAX_POSITIONS = 32768


def _default_dir(
    seed: int, arch: str = "qwen3", max_positions: int = DEFAULT_MAX_POSITIONS
) -> Path:
    """The cache key names every setting that changes the checkpoint: seed, arch and (when not
    the default, so existing directories keep their names) ``max_position_embeddings``."""
    suffix = "" if max_positions == DEFAULT_MAX_POSITIONS else f"-p{max_positions}"
    return cache_dir() / "models" / f"tiny-{arch}-s{seed}{suffix}"


def _is_complete(
    path: Path, arch: str = "qwen3", max_positions: int = DEFAULT_MAX_POSITIONS
) -> bool:
    """Built completely, by this version of the recipe, for `arch` and `max_positions` (else it
    is rebuilt)."""
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format") == FORMAT_VERSION
        and marker.get("arch", "qwen3") == arch
        and marker.get("max_position_embeddings", DEFAULT_MAX_POSITIONS) == max_positions
    )


def build_tokenizer(max_positions: int = DEFAULT_MAX_POSITIONS):
    """Train a deterministic byte-level BPE tokenizer on the bundled corpus.

    Returns a `transformers.PreTrainedTokenizerFast` with the special tokens, the chat
    template, eos = ``<|im_end|>`` and pad = ``<|endoftext|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus keeps pair counts distinct enough for a stable merge order.
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=max_positions,
    )
    # Qwen keeps the tool-call tags as added (non-special) tokens: they survive
    # `skip_special_tokens=True` so the gateway can parse tool calls from decoded text.
    fast.add_tokens(TOOL_TOKENS, special_tokens=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _init_weights(config, seed: int) -> dict:
    """Random weights of ``config``'s architecture (qwen3, llama, qwen2), initialised the way
    transformers does it.

    Linear and embedding weights ~ N(0, initializer_range) (the pad row of the embedding is
    zero), RMSNorm weights 1; ``lm_head`` is tied to the embedding and not stored. Qwen3's
    q/k norms and Qwen2's q/k/v biases are there only in their families; the biases are drawn
    like the weights (transformers zeroes them) so that a model that ignored them would show.
    Building
    the state dict directly avoids importing the modeling code (~5 s on a loaded 2-core box),
    which keeps `make_tiny_model` fast for tokenizer-only users.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    h, inter = config.hidden_size, config.intermediate_size
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or h // nh
    arch = config.model_type

    def normal(*shape):
        return torch.empty(shape).normal_(0.0, std, generator=g)

    emb = normal(config.vocab_size, h)
    emb[config.pad_token_id] = 0.0
    weights = {"model.embed_tokens.weight": emb}
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        weights |= {
            pre + "self_attn.q_proj.weight": normal(nh * hd, h),
            pre + "self_attn.k_proj.weight": normal(nkv * hd, h),
            pre + "self_attn.v_proj.weight": normal(nkv * hd, h),
            pre + "self_attn.o_proj.weight": normal(h, nh * hd),
            pre + "mlp.gate_proj.weight": normal(inter, h),
            pre + "mlp.up_proj.weight": normal(inter, h),
            pre + "mlp.down_proj.weight": normal(h, inter),
            pre + "input_layernorm.weight": torch.ones(h),
            pre + "post_attention_layernorm.weight": torch.ones(h),
        }
        if arch == "qwen3":
            weights[pre + "self_attn.q_norm.weight"] = torch.ones(hd)
            weights[pre + "self_attn.k_norm.weight"] = torch.ones(hd)
        if arch == "qwen2":
            weights[pre + "self_attn.q_proj.bias"] = normal(nh * hd)
            weights[pre + "self_attn.k_proj.bias"] = normal(nkv * hd)
            weights[pre + "self_attn.v_proj.bias"] = normal(nkv * hd)
    weights["model.norm.weight"] = torch.ones(h)
    return weights


def _config(arch: str, max_positions: int = DEFAULT_MAX_POSITIONS, **kw):
    """The tiny shape in `arch`'s config class (head_dim 16 in each), RoPE over
    `max_positions` positions (plain RoPE: no scaling, so any length up to it is exact)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shape = dict(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=int(max_positions),
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, rope_theta=1_000_000.0, **shape, **kw), "Qwen3ForCausalLM"
    if arch == "llama":  # as SmolLM2: head_dim implied by hidden / heads, rope_theta 1e5
        return LlamaConfig(rope_theta=100_000.0, **shape, **kw), "LlamaForCausalLM"
    if arch == "qwen2":
        return Qwen2Config(rope_theta=1_000_000.0, **shape, **kw), "Qwen2ForCausalLM"
    raise ValueError(f"arch={arch!r}: use one of {', '.join(ARCHS)}")


def _build(
    out: Path, seed: int, arch: str = "qwen3", max_positions: int = DEFAULT_MAX_POSITIONS
) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(max_positions)
    config, architecture = _config(
        arch,
        max_positions,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # A larger init than 0.02 gives a peaked, non-uniform next-token distribution, which
        # makes sampling/top-k/top-p behaviour (and tests of it) meaningful.
        initializer_range=0.2,
        dtype="float32",
    )
    config.architectures = [architecture]
    config.save_pretrained(out)
    save_file(_init_weights(config, seed), out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {
        "seed": seed,
        "format": FORMAT_VERSION,
        "arch": arch,
        "max_position_embeddings": max_positions,
    }
    (out / _MARKER).write_text(json.dumps(marker))


def make_tiny_model(
    out_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    arch: str = "qwen3",
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
) -> str:
    """Return a directory holding the tiny checkpoint for `seed`, `arch` and
    `max_position_embeddings` (the context it serves; long presets ask for 262144 to 1M+),
    building it if needed.

    Default location: ``$GYRE_CACHE/models/tiny-{arch}-s{seed}`` (GYRE_CACHE defaults to
    ``~/.cache/gyre``), with ``-p{max_position_embeddings}`` appended when not the default.
    The weights do not depend on the setting (RoPE has no learned parameters). A complete directory is returned as is. The build happens in a
    temporary sibling directory that is renamed into place, so concurrent callers never see a
    half-written checkpoint (the loser of a race discards its copy).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: use one of {', '.join(ARCHS)}")
    mp = int(max_position_embeddings)
    if mp < 1:
        raise ValueError(f"max_position_embeddings={mp}: must be >= 1")
    out = Path(out_dir) if out_dir is not None else _default_dir(seed, arch, mp)
    if _is_complete(out, arch, mp):
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
    try:
        _build(tmp, seed, arch, mp)
        try:
            os.rename(tmp, out)  # atomic; also replaces an empty directory
        except OSError:
            if _is_complete(out, arch, mp):  # another process won the race
                return str(out)
            # `out` exists, is not empty and not complete (e.g. a user-made dir with other
            # files): move the files in, the completion marker last.
            for item in sorted(tmp.iterdir(), key=lambda p: p.name == _MARKER):
                os.replace(item, out / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


if __name__ == "__main__":
    print(make_tiny_model())
