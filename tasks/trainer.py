"""Tree-packed policy training with a transformers causal LM.

One forward per micro-batch over a packed tree: tokens in topological order,
``position_ids`` = depth in the path, and a dense 4D ancestor mask handed to the
model as ``attention_mask`` (transformers returns a 4D mask to attention as is;
SDPA takes a bool mask, True = attend). Every token then sees exactly its own
path, so its logits equal those of a flat forward over that path, and each
unique token is computed once. FlexAttention would avoid the dense (N, N) mask
but has no backward on CPU in torch 2.13; SDPA is used everywhere.

Log-probabilities are taken only where needed: the hidden state of each
trainable token's parent goes through ``lm_head`` (T rows, not N).

``tree_loss_and_grads`` / ``flat_loss_and_grads`` are the pure functions behind
the tree-vs-flat equivalence test; ``Trainer`` wraps the first with an optimizer
and checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tasks import losses
from tasks.packing import Packed, ancestor_mask, pack
from tasks.sampler import Sample

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


class TrainerError(ValueError):
    """Invalid trainer settings or inputs."""


@dataclass(frozen=True)
class LossConfig:
    """Which loss and its constants (see tasks/losses.py)."""

    loss: str = "ppo_clip"  # ppo_clip | grpo | tis
    eps_low: float = 0.2
    eps_high: float = 0.28
    is_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.loss not in losses.LOSSES:
            raise TrainerError(
                f"loss={self.loss!r} is unknown; use one of {', '.join(losses.LOSSES)}"
            )


def token_losses(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    cfg: LossConfig,
    is_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T,) per-token loss terms for ``cfg.loss``."""
    if cfg.loss == "tis":
        return losses.truncated_is_token_loss(
            logp, behaviour_logp, weight_pos, weight_neg, cap=cfg.is_cap
        )
    lo, hi = (cfg.eps_low, cfg.eps_low) if cfg.loss == "grpo" else (cfg.eps_low, cfg.eps_high)
    return losses.ppo_clip_token_loss(
        logp,
        behaviour_logp,
        weight_pos,
        weight_neg,
        eps_low=lo,
        eps_high=hi,
        is_mask=is_mask,
        is_cap=cfg.is_cap,
    )


def _rmsnorm_keep_fp64(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """RMSNorm that upcasts to float32 as transformers does, but never downcasts float64."""
    input_dtype = hidden_states.dtype
    compute = torch.float64 if input_dtype == torch.float64 else torch.float32
    h = hidden_states.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(input_dtype)


def keep_norms_in_fp64(model: torch.nn.Module) -> int:
    """Patch the model's RMSNorm layers so that a float64 model stays float64.

    transformers' Qwen/Llama RMSNorm computes in float32 whatever the input dtype
    (meant as an upcast for half precision); in a float64 model that rounds every
    norm, and tree vs flat gradients then differ at ~1e-8 (a shared prefix's
    gradient is rounded once in the tree, once per branch flat). Returns the
    number of layers patched. No effect on float32/bf16 inputs.
    """
    n = 0
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
            mod.forward = types.MethodType(_rmsnorm_keep_fp64, mod)
            n += 1
    return n


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "model", None) or model.get_decoder()


def _gather_logp(
    model: torch.nn.Module, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """log p(targets | hidden[rows]); hidden (N, H), rows/targets (T,) -> (T,)."""
    logits = model.lm_head(hidden[rows])  # (T, V)
    return torch.log_softmax(
        logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, -1
    ).gather(-1, targets[:, None])[:, 0]


def packed_logprobs(
    model: torch.nn.Module, packed: Packed, sel: np.ndarray, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Current-policy log-probs of tokens ``sel`` (T,) of a packed micro-batch, shape (T,).

    One forward with the ancestor mask (1, 1, N, N) and depth position ids (1, N).
    """
    ids = torch.as_tensor(packed.token_ids, device=device)[None]  # (1, N)
    pos = torch.as_tensor(packed.positions, device=device)[None]  # (1, N)
    mask = torch.as_tensor(ancestor_mask(packed.parent_idx), device=device)[
        None, None
    ]  # (1, 1, N, N)
    if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
            ~mask, torch.finfo(dtype).min
        )
    hidden = _decoder(model)(
        input_ids=ids, attention_mask=mask, position_ids=pos
    ).last_hidden_state[0]  # (N, H)
    rows = torch.as_tensor(packed.parent_idx[sel], device=device)
    return _gather_logp(model, hidden, rows, ids[0, torch.as_tensor(sel, device=device)])


def _is_mask(
    versions: np.ndarray, min_version: int | None, device: str | torch.device
) -> torch.Tensor | None:
    if min_version is None:
        return None
    return torch.as_tensor((versions >= 0) & (versions < min_version), device=device)


def tree_loss_and_grads(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    cfg: LossConfig,
    normalizer: float,
    max_tokens: int = 4096,
    min_version: int | None = None,
    device: str | torch.device = "cpu",
    backward: bool = True,
) -> dict[str, float]:
    """Tree-packed loss over ``samples``, gradients accumulated into ``model`` (no step).

    Tokens with a policy version below ``min_version`` use truncated IS. Returns
    plain metrics: loss, tokens (forwarded), trainable (weighted tokens), micro
    batches, clip fraction.
    """
    total = 0.0
    n_tok = n_train = 0
    clipped = 0.0
    packs = pack(samples, max_tokens)
    for p in packs:
        sel = np.flatnonzero(((p.weight_pos != 0) | (p.weight_neg != 0)) & (p.parent_idx >= 0))
        n_tok += p.n_tokens
        if not sel.size:
            continue
        logp = packed_logprobs(model, p, sel, device)
        dt = logp.dtype
        blp = torch.as_tensor(p.behaviour_logprobs[sel], dtype=dt, device=device)
        wp = torch.as_tensor(p.weight_pos[sel], dtype=dt, device=device)
        wn = torch.as_tensor(p.weight_neg[sel], dtype=dt, device=device)
        loss = (
            token_losses(
                logp, blp, wp, wn, cfg, _is_mask(p.versions[sel], min_version, device)
            ).sum()
            / normalizer
        )
        if backward:
            loss.backward()
        total += float(loss.detach())
        n_train += sel.size
        clipped += (
            losses.clip_fraction(logp, blp, wp, wn, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
            * sel.size
        )
    return {
        "loss": total,
        "tokens": float(n_tok),
        "trainable_tokens": float(n_train),
        "micro_batches": float(len(packs)),
        "clip_fraction": clipped / n_train if n_train else 0.0,
    }


def flat_loss_and_grads(
    model: torch.nn.Module,
    branches: Sequence[Sample],
    *,
    cfg: LossConfig,
    normalizer: float,
    min_version: int | None = None,
    device: str | torch.device = "cpu",
    backward: bool = True,
) -> dict[str, float]:
    """The reference: every branch (a chain sample, ``parent_idx[i] == i - 1``) is a
    plain causal sequence forwarded on its own with the model's default mask and
    positions. Same loss terms and normaliser as ``tree_loss_and_grads``."""
    total = 0.0
    n_tok = 0
    for b in branches:
        n = b.n_tokens
        if np.any(b.parent_idx != np.arange(n) - 1):
            raise TrainerError(
                f"branch {b.sample_id} is not a chain: flat branches need parent_idx = i - 1"
            )
        sel = np.flatnonzero(((b.weight_pos != 0) | (b.weight_neg != 0)) & (b.parent_idx >= 0))
        n_tok += n
        if not sel.size:
            continue
        ids = torch.as_tensor(b.token_ids.astype(np.int64), device=device)[None]  # (1, L)
        hidden = _decoder(model)(input_ids=ids).last_hidden_state[0]  # (L, H)
        logp = _gather_logp(
            model, hidden, torch.as_tensor(sel - 1, device=device), ids[0, torch.as_tensor(sel)]
        )
        dt = logp.dtype
        blp = torch.as_tensor(b.behaviour_logprobs[sel], dtype=dt, device=device)
        wp = torch.as_tensor(b.weight_pos[sel], dtype=dt, device=device)
        wn = torch.as_tensor(b.weight_neg[sel], dtype=dt, device=device)
        loss = (
            token_losses(
                logp, blp, wp, wn, cfg, _is_mask(b.versions[sel], min_version, device)
            ).sum()
            / normalizer
        )
        if backward:
            loss.backward()
        total += float(loss.detach())
    return {"loss": total, "tokens": float(n_tok)}


class Trainer:
    """A policy, its AdamW optimizer, and one-step-at-a-time tree-packed training.

    ``step(samples)`` packs the samples into micro-batches of at most
    ``max_tokens_per_micro`` tokens, accumulates gradients of the token-level loss
    normalised by the step's flat trainable-token count, clips the gradient norm,
    takes one optimizer step and bumps ``version``.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        lr: float = 1e-5,
        loss: str = "ppo_clip",
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.28,
        max_tokens_per_micro: int = 4096,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        device: str = "cpu",
        max_grad_norm: float | None = 1.0,
        weight_decay: float = 0.0,
        max_staleness: int | None = None,
        is_cap: float = 2.0,
        version: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        errors = []
        if lr <= 0:
            errors.append(f"lr={lr} must be > 0")
        if max_tokens_per_micro < 1:
            errors.append(f"max_tokens_per_micro={max_tokens_per_micro} must be >= 1")
        if not (0 <= clip_eps_low < 1) or clip_eps_high < 0:
            errors.append(
                f"clip_eps_low={clip_eps_low}, clip_eps_high={clip_eps_high}: need 0 <= low < 1, high >= 0"
            )
        try:
            self.loss_cfg = LossConfig(loss, clip_eps_low, clip_eps_high, is_cap)
        except TrainerError as e:
            errors.append(str(e))
        if errors:
            raise TrainerError("; ".join(errors))
        torch.manual_seed(seed)
        self.model_dir = str(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.lr = lr
        self.max_tokens_per_micro = max_tokens_per_micro
        self.max_grad_norm = max_grad_norm
        self.max_staleness = max_staleness
        self.version = version
        self.n_steps = 0
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=dtype, attn_implementation="sdpa"
        ).to(self.device)
        if dtype == torch.float64:
            keep_norms_in_fp64(self.model)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=weight_decay
        )

    def step(
        self, samples: Sequence[Sample], current_version: int | None = None
    ) -> dict[str, float]:
        """One optimizer step on ``samples``; returns ``train/*`` metrics."""
        t0 = time.perf_counter()
        version = self.version if current_version is None else current_version
        min_version = version - self.max_staleness if self.max_staleness is not None else None
        normalizer = float(sum(s.n_flat_trainable for s in samples)) or 1.0
        self.optimizer.zero_grad(set_to_none=True)
        m = tree_loss_and_grads(
            self.model,
            samples,
            cfg=self.loss_cfg,
            normalizer=normalizer,
            max_tokens=self.max_tokens_per_micro,
            min_version=min_version,
            device=self.device,
        )
        params = [p for p in self.model.parameters() if p.grad is not None]
        if params:
            max_norm = self.max_grad_norm if self.max_grad_norm is not None else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            self.optimizer.step()
        else:
            grad_norm = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.n_steps += 1
        lags = [
            version - s.versions[(s.versions >= 0) & s.trainable_mask].mean()
            for s in samples
            if ((s.versions >= 0) & s.trainable_mask).any()
        ]
        return {
            "train/loss": m["loss"],
            "train/tokens": m["tokens"],
            "train/trainable_tokens": m["trainable_tokens"],
            "train/flat_tokens": float(sum(s.n_flat_tokens for s in samples)),
            "train/flat_trainable_tokens": float(sum(s.n_flat_trainable for s in samples)),
            "train/grad_norm": grad_norm,
            "train/clip_fraction": m["clip_fraction"],
            "train/micro_batches": m["micro_batches"],
            "train/n_samples": float(len(samples)),
            "train/reward_mean": float(np.mean([s.reward for s in samples])) if samples else 0.0,
            "train/staleness_mean": float(np.mean(lags)) if lags else 0.0,
            "train/lr": float(self.optimizer.param_groups[0]["lr"]),
            "train/version": float(self.version),
            "train/step_time_s": time.perf_counter() - t0,
        }

    def save(self, out_dir: str) -> str:
        """Weights (safetensors via ``save_pretrained``), tokenizer files copied from
        ``model_dir`` when present, optimizer state in ``optimizer.pt`` and the
        trainer's counters in ``trainer_state.json``. Returns ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        src = Path(self.model_dir)
        for name in TOKENIZER_FILES:
            if (src / name).is_file() and src.resolve() != out.resolve():
                shutil.copy2(src / name, out / name)
        torch.save(self.optimizer.state_dict(), out / OPTIMIZER_FILE)
        (out / STATE_FILE).write_text(
            json.dumps({"version": self.version, "n_steps": self.n_steps})
        )
        return str(out)

    @classmethod
    def load(cls, ckpt_dir: str, **kwargs) -> Trainer:
        """A trainer from a ``save`` directory: weights, optimizer state and counters
        (``lr`` and other settings come from ``kwargs``, as for ``__init__``)."""
        ckpt = Path(ckpt_dir)
        state = json.loads((ckpt / STATE_FILE).read_text()) if (ckpt / STATE_FILE).is_file() else {}
        kwargs.setdefault("version", int(state.get("version", 0)))
        t = cls(str(ckpt), **kwargs)
        t.n_steps = int(state.get("n_steps", 0))
        if (ckpt / OPTIMIZER_FILE).is_file():
            sd = torch.load(ckpt / OPTIMIZER_FILE, map_location=t.device, weights_only=True)
            t.optimizer.load_state_dict(sd)
            for g in t.optimizer.param_groups:
                g["lr"] = t.lr
        else:
            log.warning("no %s in %s: optimizer starts fresh", OPTIMIZER_FILE, ckpt)
        return t
