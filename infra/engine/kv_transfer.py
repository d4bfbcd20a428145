"""Serialized KV of a token prefix: gyre's KV migration between engines.

A blob is a safetensors file with two tensors, ``input_ids`` (int64, (n,)) and ``kv``
(``(L, 2, H_kv, n, D)``, the engine dtype), and string metadata naming the model family
(``model_type``), its shape and the weight version that computed it. The importer checks the
family and shape before inserting the prefix into its radix cache; the weight version is informative (KV from older weights is still valid
as a cache, just stale, exactly like a radix entry that survived a reload without a flush).
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load, save

FORMAT = "gyre-kv/1"


class KVFormatError(ValueError):
    """A blob that is not a gyre KV export, or one for a differently shaped model."""


def dumps(input_ids: list[int], kv: torch.Tensor | None, meta: dict) -> bytes:
    ids = torch.tensor(input_ids, dtype=torch.int64)
    if kv is None:
        kv = torch.zeros(
            (meta["num_layers"], 2, meta["num_kv_heads"], 0, meta["head_dim"]),
            dtype=torch.float32,
        )
    header = {"format": FORMAT, "meta": json.dumps(meta)}
    return save({"input_ids": ids, "kv": kv.contiguous()}, metadata=header)


def loads(blob: bytes) -> tuple[list[int], torch.Tensor, dict]:
    try:
        tensors = load(bytes(blob))
        meta_raw = _metadata(blob)
    except Exception as e:
        raise KVFormatError(f"not a gyre KV blob: {e}") from e
    if meta_raw.get("format") != FORMAT or "input_ids" not in tensors or "kv" not in tensors:
        raise KVFormatError(f"not a {FORMAT} blob")
    meta = json.loads(meta_raw["meta"])
    ids = tensors["input_ids"].tolist()
    kv = tensors["kv"]
    if kv.ndim != 5 or kv.shape[1] != 2 or kv.shape[3] != len(ids):
        raise KVFormatError(f"kv shape {tuple(kv.shape)} does not fit {len(ids)} tokens")
    return ids, kv, meta


def _metadata(blob: bytes) -> dict:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(bytes(blob[8 : 8 + n])).get("__metadata__", {})


def check_compatible(meta: dict, mine: dict) -> None:
    """Refuse KV of another model architecture: another shape, or another family of the same
    shape (``model_type``: a Qwen3 and a Llama can share every KV dimension). A blob written
    before ``model_type`` was recorded is checked on its shape only."""
    keys = ["num_layers", "num_kv_heads", "head_dim"]
    if meta.get("model_type") and mine.get("model_type"):
        keys.insert(0, "model_type")
    for key in keys:
        if meta.get(key) != mine.get(key):
            raise KVFormatError(
                f"KV blob {key}={meta.get(key)} but this engine has {mine.get(key)}: "
                "export and import must serve the same model architecture"
            )
