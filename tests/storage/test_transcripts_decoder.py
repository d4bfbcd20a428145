"""The text views decode without transformers where transformers would decode with the
checkpoint's tokenizer.json backend unchanged (storage/transcripts.py): the same text,
token for token, and a cold ``gyre sql`` on ``calls`` never imports transformers (or torch;
nor pandas, which DuckDB imports when an Arrow table is registered: storage/sql.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from tokenizers import Tokenizer

from infra.engine.tiny_model import make_tiny_model
from storage.checkpoints import publish_checkpoint
from storage.schemas import TITO_SCHEMA
from storage.store import Store
from storage.transcripts import load_decoder, plain_backend

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = Path.home() / ".cache/gyre/models/smollm2-135m-instruct"


def _dirs() -> list:
    out = [pytest.param("tiny", id="tiny")]
    mark = pytest.mark.skipif(
        not (SMOLLM2 / "tokenizer.json").is_file(), reason="`gyre model prepare smollm2` not run"
    )
    return [*out, pytest.param("smollm2", id="smollm2", marks=mark)]


def _path(name: str) -> str:
    return make_tiny_model() if name == "tiny" else str(SMOLLM2)


@pytest.mark.parametrize("name", _dirs())
def test_the_backend_decodes_every_id_as_transformers_does(name):
    from transformers import AutoTokenizer

    path = _path(name)
    fast, ref = load_decoder(path), AutoTokenizer.from_pretrained(path)
    assert isinstance(fast, Tokenizer)  # the light path is the one taken
    n = len(ref)
    singles = [[i] for i in range(n)]
    rng = random.Random(0)
    special = ref.all_special_ids
    seqs = [
        [rng.choice(special) if rng.random() < 0.1 else rng.randrange(n) for _ in range(20)]
        for _ in range(300)
    ]
    for ids in singles + seqs + [[]]:
        assert fast.decode(ids, skip_special_tokens=False) == ref.decode(
            ids, skip_special_tokens=False
        ), ids


def _copy_tokenizer(tmp_path: Path, **config) -> str:
    src = Path(make_tiny_model())
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(src / "tokenizer.json", d)
    cfg = json.loads((src / "tokenizer_config.json").read_text()) | config
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize(
    "config",
    [
        {"tokenizer_class": "Qwen2Tokenizer"},  # a class that rebuilds the backend itself
        {"pad_token": "<|not-in-the-file|>"},  # transformers would add it under a new id
        {"extra_special_tokens": ["<|im_start|>", "<|nor-this|>"]},
        {  # a clean-up transformers applies (it skips it for BPE unless forced)
            "clean_up_tokenization_spaces": True,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
        },
    ],
)
def test_checkpoints_transformers_would_change_take_transformers(tmp_path, config):
    path = _copy_tokenizer(tmp_path, **config)
    assert plain_backend(path) is None


def test_the_plain_case_and_bpe_clean_up_take_the_backend(tmp_path):
    assert plain_backend(_copy_tokenizer(tmp_path)) is not None
    (tmp_path / "tok").rename(tmp_path / "tok0")
    assert plain_backend(_copy_tokenizer(tmp_path, clean_up_tokenization_spaces=True)) is not None
    os.remove(tmp_path / "tok" / "tokenizer.json")
    assert plain_backend(str(tmp_path / "tok")) is None  # no file: transformers says why


def test_a_cold_gyre_sql_on_the_text_views_imports_no_transformers(tmp_path):
    st = Store(str(tmp_path / "store"))
    publish_checkpoint(st, "r1", make_tiny_model(), 0)
    tok = Tokenizer.from_file(os.path.join(make_tiny_model(), "tokenizer.json"))
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False).ids
    out = tok.encode("hello there", add_special_tokens=False).ids
    row = {
        "run_id": "r1", "session_id": "s1", "request_id": "s1-0", "seq_no": 0,
        "parent_request_id": None, "prefix_len": 0, "new_input_ids": ids, "output_ids": out,
        "output_logprobs": [0.0] * len(out), "weight_version": 0, "cell_id": "c0",
        "finish_reason": "stop", "cached_tokens": 0, "t_start": 0.0, "t_end": 1.0,
        "endpoint": "chat",
    }  # fmt: skip
    st.append("tito", pa.Table.from_pylist([row], schema=TITO_SCHEMA))
    probe = (
        "import sys; from flows.cli import main; "
        f"rc = main(['sql', '--store', {st.url!r}, '--format', 'json', "
        "'SELECT output_text AS t FROM calls UNION ALL SELECT text FROM transcripts']); "
        "print('loaded:', sorted(m for m in ('transformers', 'torch', 'pandas') if m in sys.modules)); "
        "sys.exit(rc)"
    )
    p = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    *rows, loaded = p.stdout.splitlines()
    texts = sorted(json.loads(r)["t"] for r in rows)
    assert texts == ["<|im_start|>user\nhi<|im_end|>\nhello there", "hello there"]
    assert loaded == "loaded: []", p.stdout


def test_no_progress_bar_among_the_rows(tmp_path):
    """DuckDB draws its progress bar on stdout for a query past 2 s: between `gyre sql`'s
    rows (a cold tokenizer load took that long), so every connection turns it off."""
    from storage.sql import query

    st = Store(str(tmp_path / "store"))
    got = query(st, "SELECT current_setting('enable_progress_bar') AS bar").to_pylist()
    assert got == [{"bar": False}]
