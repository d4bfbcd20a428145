"""Tree-packed policy training: a model, its optimizer, steps and checkpoints.

``Trainer.step(samples)`` packs samples into micro-batches (tasks/packing.py),
accumulates the token-level policy loss and its gradients over them
(tasks/packed_loss.py: one forward per micro-batch with attention restricted to
each token's path) and takes one AdamW step. ``save`` / ``Trainer.load`` write
and restore weights (safetensors), tokenizer files and optimizer state.

The pure loss functions are re-exported here: ``tree_loss_and_grads``,
``flat_loss_and_grads`` (the reference), ``packed_logprobs``, ``LossConfig``.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from storage.checkpoints import write_digest
from tasks.train.logprobs import SamplingDist, SamplingDistError
from tasks.train.packed_loss import (
    LossConfig,
    TrainerError,
    flat_loss_and_grads,
    keep_norms_in_fp64,
    packed_logprobs,
    token_losses,
    tree_loss_and_grads,
)
from tasks.trajectory.sampler import Sample, staleness

__all__ = [
    "LossConfig",
    "SamplingDist",
    "Trainer",
    "TrainerError",
    "flat_loss_and_grads",
    "keep_norms_in_fp64",
    "packed_logprobs",
    "token_losses",
    "tree_loss_and_grads",
]

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


class Trainer:
    """A policy, its AdamW optimizer, and one-step-at-a-time tree-packed training.

    ``step(samples)`` packs the samples into micro-batches of at most
    ``max_tokens_per_micro`` tokens, accumulates gradients of the token-level loss
    normalised by the step's flat trainable-token count, clips the gradient norm,
    takes one optimizer step and bumps ``version``.

    Settings beyond the core ones: ``loss`` is ``ppo_clip`` (asymmetric clip
    ``clip_eps_low``/``clip_eps_high``), ``grpo`` (symmetric clip at
    ``clip_eps_low``) or ``tis`` (truncated-IS policy gradient, cap ``is_cap``);
    ``max_staleness``: tokens generated more than that many versions before
    ``version`` get truncated IS (cap ``is_cap``) instead of the clipped ratio;
    ``attention``: ``tree`` (chain-wise, default) or ``dense`` (4D mask);
    ``version``: the policy version the weights are (``load`` reads it back).
    A float64 trainer keeps RMSNorm in float64 (``keep_norms_in_fp64``).

    ``temperature`` / ``top_p`` / ``top_k``: the sampling processing of the rollouts; the
    new policy's log-probs are taken under the same processing (tasks/train/logprobs.py),
    so that the ratio to the engine's reported logprob is 1 at zero staleness.
    ``kl_coef``: weight of the k3 KL to a frozen reference policy loaded from
    ``ref_model_dir`` (default: ``model_dir``, the warm start; a resumed trainer must be
    given the v0 directory). ``entropy_coef``: weight of the entropy bonus.

    Determinism: the same weights, seed, settings and samples (in the same order) give
    the same update bit for bit on one machine with the same torch thread count
    (``torch.get_num_threads()``: it sets how CPU matmuls split their sums). Other
    thread counts, another BLAS / CPU kind, a GPU without
    ``torch.use_deterministic_algorithms`` or another sample order (packing and the
    order of the sums follow it) change the low bits.
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
        attention: str = "tree",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
        ref_model_dir: str | None = None,
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
            self.loss_cfg = LossConfig(
                loss, clip_eps_low, clip_eps_high, is_cap, kl_coef, entropy_coef
            )
        except TrainerError as e:
            errors.append(str(e))
        try:
            self.dist = SamplingDist(temperature, top_p, top_k)
        except SamplingDistError as e:
            errors.append(str(e))
        if attention not in ("tree", "dense"):
            errors.append(f"attention={attention!r}: use 'tree' (chain-wise) or 'dense' (4D mask)")
        if errors:
            raise TrainerError("; ".join(errors))
        torch.manual_seed(seed)
        self.attention = attention
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
        self.ref_model_dir = None
        self.ref_model: torch.nn.Module | None = None
        if kl_coef > 0:
            self.ref_model_dir = str(ref_model_dir or model_dir)
            self.ref_model = AutoModelForCausalLM.from_pretrained(
                self.ref_model_dir, dtype=dtype, attn_implementation="sdpa"
            ).to(self.device)
            if dtype == torch.float64:
                keep_norms_in_fp64(self.ref_model)
            self.ref_model.eval().requires_grad_(False)

    def loss_and_grads(
        self,
        samples: Sequence[Sample],
        current_version: int | None = None,
        *,
        normalizer: float | None = None,
        cp_samples: Sequence[Sample] = (),
        cp_group=None,
    ) -> dict[str, float]:
        """Accumulate the step's loss gradients into the model (no optimizer step).

        The loss is a token mean over the step: every term is divided by the flat
        trainable-token count of the samples (``Sample.n_flat_trainable``), so the tree
        loss equals per-branch flat training; a data-parallel member passes the whole
        batch's ``normalizer`` instead of its shard's. Tokens older than ``current_version -
        max_staleness`` get truncated IS. ``cp_samples``: trained context parallel with the
        members of ``cp_group`` (each member passes the same ones; ``tree_loss_and_grads``).
        Returns the raw metrics of ``tree_loss_and_grads``."""
        version = self.version if current_version is None else current_version
        min_version = version - self.max_staleness if self.max_staleness is not None else None
        if normalizer is None:
            normalizer = float(sum(s.n_flat_trainable for s in samples)) or 1.0
        return tree_loss_and_grads(
            self.model,
            samples,
            cfg=self.loss_cfg,
            normalizer=normalizer,
            max_tokens=self.max_tokens_per_micro,
            min_version=min_version,
            device=self.device,
            attention=self.attention,
            dist=self.dist,
            ref_model=self.ref_model,
            cp_samples=cp_samples,
            cp_group=cp_group,
        )

    def step(
        self,
        samples: Sequence[Sample],
        current_version: int | None = None,
        *,
        normalizer: float | None = None,
        reduce_grads: Callable[[torch.nn.Module], None] | None = None,
        cp_samples: Sequence[Sample] = (),
        cp_group=None,
    ) -> dict[str, float]:
        """One optimizer step on ``samples``; returns ``train/*`` metrics.

        Data parallel (tasks/train/dp.py): each member passes its shard, the whole batch's
        ``normalizer`` and ``reduce_grads`` (sums gradients over members before clipping);
        ``cp_samples`` (the same on every member) are trained context parallel over
        ``cp_group``.
        """
        t0 = time.perf_counter()
        version = self.version if current_version is None else current_version
        self.optimizer.zero_grad(set_to_none=True)
        m = self.loss_and_grads(
            samples, version, normalizer=normalizer, cp_samples=cp_samples, cp_group=cp_group
        )
        if reduce_grads is not None:
            reduce_grads(self.model)
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
        if cp_samples:  # counted once over the group: by its first member
            import torch.distributed as tdist

            if tdist.get_rank(group=cp_group) == 0:
                samples = [*samples, *cp_samples]
        lags = [x for x in (staleness(s, version) for s in samples) if not math.isnan(x)]
        return {
            "train/loss": m["loss"],
            "train/pg_loss": m["pg_loss"],
            "train/kl": m["kl"],
            "train/entropy": m["entropy"],
            "train/is_tokens": m["is_tokens"],
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
        """Weights (safetensors via ``save_pretrained``) and their digest (an engine that
        loads them must serve that digest: storage/checkpoints.py), tokenizer files copied
        from ``model_dir`` when present, optimizer state in ``optimizer.pt`` and the
        trainer's counters in ``trainer_state.json``. Returns ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        write_digest(self.model, str(out))
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
        (``lr`` and other settings come from ``kwargs``, as for ``__init__``).

        With ``kl_coef > 0`` the reference must be named (``ref_model_dir``) when the
        checkpoint is not version 0: its own weights are not the warm start."""
        ckpt = Path(ckpt_dir)
        state = json.loads((ckpt / STATE_FILE).read_text()) if (ckpt / STATE_FILE).is_file() else {}
        kwargs.setdefault("version", int(state.get("version", 0)))
        if kwargs.get("kl_coef", 0.0) > 0 and not kwargs.get("ref_model_dir") and kwargs["version"]:
            raise TrainerError(
                f"kl_coef > 0 resuming {ckpt_dir} at version {kwargs['version']}: pass "
                "ref_model_dir= the version-0 (warm-start) checkpoint, the KL reference"
            )
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
