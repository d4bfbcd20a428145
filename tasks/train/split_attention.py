"""Exact attention of query rows over (visible prefix keys) + (their own causal diagonal).

Every query block of tree attention sees an unmasked prefix (its path's keys and the
chain's keys before the block) and a square causal diagonal (the block's own keys). A
boolean mask over both makes SDPA read an (rows, keys) mask and skip nothing; here the two
parts run as two fused flash-attention calls (no mask, and ``is_causal`` on the square) and
are merged by their log-sum-exp, as ring attention does. The backward calls the flash
backward of each part with the *merged* output and log-sum-exp, which makes each part's
probabilities and the softmax correction term the whole row's, so the gradients are exact.

On CPU this is torch's ``_scaled_dot_product_flash_attention_for_cpu`` (fp32/fp64/bf16);
elsewhere ``available`` says no and callers keep the masked blocks.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import torch

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def available(query: torch.Tensor, dropout: float) -> bool:
    """Whether ``prefix_causal`` runs for this query (CPU, no dropout, a float dtype)."""
    return (
        query.device.type == "cpu"
        and dropout == 0.0
        and query.dtype in (torch.float32, torch.float64, torch.bfloat16)
    )


class _PrefixCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kp, vp, kd, vd, scale):
        out, lse = _fwd(q, kd, vd, 0.0, True, scale=scale)
        if kp.shape[2]:
            op, lp = _fwd(q, kp, vp, 0.0, False, scale=scale)
            both = torch.logaddexp(lp, lse)
            out = (
                op * (lp - both).exp().unsqueeze(-1) + out * (lse - both).exp().unsqueeze(-1)
            ).to(q.dtype)
            lse = both
        ctx.scale = scale
        ctx.save_for_backward(q, kp, vp, kd, vd, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kp, vp, kd, vd, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dkd, dvd = _bwd(grad, q, kd, vd, out, lse, 0.0, True, scale=ctx.scale)
        dkp = dvp = None
        if kp.shape[2]:
            dq2, dkp, dvp = _bwd(grad, q, kp, vp, out, lse, 0.0, False, scale=ctx.scale)
            dq = dq + dq2
        return dq, dkp, dvp, dkd, dvd, None


def prefix_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n_prefix: int,
    scale: float | None = None,
) -> torch.Tensor:
    """query (1, H, L, D); key/value (1, Hkv, n_prefix + L, D): row r sees keys
    ``[0, n_prefix + r]``. Returns (1, H, L, D). Grouped-query heads (Hkv | H): query head
    h reads key head h // (H / Hkv), as SDPA's ``enable_gqa``; the CPU kernels take them as
    they are (no repeated copy of the keys, forward or backward)."""
    n_rows = query.shape[2]
    if key.shape[2] != n_prefix + n_rows:
        raise ValueError(
            f"{n_rows} query rows over a prefix of {n_prefix} need {n_prefix + n_rows} keys, "
            f"got {key.shape[2]}"
        )
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    return _PrefixCausal.apply(
        query,
        key[:, :, :n_prefix],
        value[:, :, :n_prefix],
        key[:, :, n_prefix:],
        value[:, :, n_prefix:],
        scale,
    )
