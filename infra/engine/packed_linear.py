"""oneDNN prepacked weights for the engine's linear layers (CPU, fp32).

A decode step multiplies a few rows (one per running request) by every weight matrix of the
model; torch's default CPU path for that is MKL's ``sgemm``, which re-lays out (packs) the
weight on every call, and on AMD CPUs takes a generic code path. oneDNN's matmul over a
weight reordered once into its blocked layout does the same fp32 multiply-adds (no reduced
precision: results differ from MKL's by summation order only, ~1e-6 relative). Measured on
the 2-core AMD EPYC machine, one thread, SmolLM2-135M's shapes: a (16 x 576) @ (576 x 1536)
matmul 0.18 ms vs 0.49 ms; the LM head (16 x 576) @ (576 x 49152) 9 ms vs 26 ms.

`pack_linears(model)` replaces the forward of every ``nn.Linear`` with one over a packed copy
of its weight. The parameters stay as they are (state dict, tied embeddings, the weights
digest), so the packed copy costs one more copy of the linear weights in memory, and it is a
snapshot: the engine changes weights only by loading a new model (`Engine._load`), which is
packed before it is swapped in. A model modified in place after packing would be served
stale; `unpack_linears` restores the plain forwards. Inference only (no autograd kernel).
"""

from __future__ import annotations

import torch


def available() -> bool:
    """oneDNN's packed linear is built into this torch (the CPU wheels have it)."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class _PackedForward:
    """A linear's forward over its packed weight (an object, so `unpack_linears` finds it)."""

    def __init__(self, linear: torch.nn.Linear):
        w = linear.weight.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, None)  # (out, in), opaque
        self.bias = None if linear.bias is None else linear.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


# Narrower matmuls are too small for oneDNN's per-call cost to pay: the tiny model's 64-wide
# layers took 4.45 ms a 16-row decode step packed vs 4.07 ms plain (SmolLM2's narrowest: 192).
MIN_FEATURES = 128


def packable(linear: torch.nn.Module, min_features: int = MIN_FEATURES) -> bool:
    w = getattr(linear, "weight", None)
    return (
        isinstance(linear, torch.nn.Linear)
        and isinstance(w, torch.Tensor)
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.layout == torch.strided
        and min(w.shape) >= min_features
    )


def pack_linears(model: torch.nn.Module, min_features: int = MIN_FEATURES) -> int:
    """Serve every CPU fp32 ``nn.Linear`` of `model` at least `min_features` wide (in and
    out) from a oneDNN-packed copy of its weight; returns how many were packed (0 where
    oneDNN is not available)."""
    if not available():
        return 0
    n = 0
    for mod in model.modules():
        forward = mod.__dict__.get("forward")
        if packable(mod, min_features) and not isinstance(forward, _PackedForward):
            mod.forward = _PackedForward(mod)  # an instance attribute shadows Linear.forward
            n += 1
    return n


def unpack_linears(model: torch.nn.Module) -> int:
    """Undo `pack_linears` (the plain ``nn.Linear.forward`` again); returns how many."""
    n = 0
    for mod in model.modules():
        if isinstance(mod.__dict__.get("forward"), _PackedForward):
            del mod.forward
            n += 1
    return n
