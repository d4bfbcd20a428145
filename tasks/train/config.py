"""Settings of processing and training (the `train` section of a run config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainConfig(BaseModel):
    """Advantages, staleness, the loss and the optimizer step."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    steps: int = Field(2, ge=1, le=10_000_000, description="optimizer steps of the run")
    lr: float = Field(1e-3, gt=0, le=1.0, description="AdamW learning rate")
    loss: Literal["ppo_clip", "grpo"] = Field(
        "ppo_clip",
        description="token loss: ppo_clip (asymmetric clip), or grpo (symmetric clip, k3 KL "
        "to the reference)",
    )
    advantage: Literal["grpo", "per_subtask"] = Field(
        "grpo",
        description="group-relative advantage of the rollout reward, or per sub-task "
        "(each turn credited by the sub-tasks it served)",
    )
    clip_eps_low: float = Field(
        0.2, ge=0, le=1, description="PPO clip below: ratio >= 1 - clip_eps_low"
    )
    clip_eps_high: float = Field(
        0.28, ge=0, le=10, description="PPO clip above (clip-higher): ratio <= 1 + clip_eps_high"
    )
    max_tokens_per_micro: int = Field(
        4096, ge=64, description="tokens per packed micro-batch (memory per forward pass)"
    )
    context_parallel_tokens: int = Field(
        0,
        ge=0,
        description="a sample of more tokens than this is trained context parallel: split "
        "over all of the step's members, each holding a slice of the sequence and "
        "gathering the others' keys/values per layer (tasks/train/context_parallel.py), "
        "for a rollout too long for one cell; shorter samples shard over members as "
        "usual. 0 = never (each long sample trains chunked on one member)",
    )
    max_staleness: int = Field(1, ge=0, description="policy versions a token may lag")
    stale_policy: Literal["drop", "is"] = Field(
        "drop",
        description="tokens lagging more than max_staleness: dropped, or trained with "
        "truncated importance sampling (is)",
    )
    is_cap: float = Field(
        2.0, gt=0, description="cap of the truncated importance ratio (stale_policy=is)"
    )
    reward_aggregation: Literal["weighted_mean", "sum", "min", "all_or_nothing"] = Field(
        "weighted_mean", description="sub-task scores -> a rollout's reward"
    )
    seed: int = Field(0, description="seed of the trainer (shuffling, init)")
    normalize_std: bool = Field(
        True,
        description="divide group-centred advantages by the group's std (GRPO); "
        "false keeps only the group baseline (Dr. GRPO)",
    )
    filter_zero_variance: bool = Field(
        True,
        description="drop groups whose advantages are all 0 (equal rewards): they carry no "
        "signal and would only dilute the token-mean normaliser; counted as "
        "train/zero_variance_groups",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the k3 KL estimate to the reference policy (the version-0 / "
        "warm-start weights), per trained token; 0 turns it off",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the entropy bonus (entropy of the sampled-from distribution), "
        "per trained token; 0 turns it off",
    )
    temperature: float | None = Field(
        None,
        gt=0,
        le=10.0,
        description="temperature the trainer's log-probs use; must be the rollouts' sampling "
        "temperature (the engine reports log-probs of the tempered distribution). None: "
        "rollout.temperature (1.0 when rollouts are greedy)",
    )
    top_p: float | None = Field(
        None,
        gt=0,
        le=1.0,
        description="top-p the trainer's log-probs renormalise over; must be the rollouts' "
        "top_p. None: rollout.top_p. Against a real SGLang server (which reports log-probs "
        "before top-p) use 1.0",
    )
    sharding: Literal["replicate", "fsdp"] = Field(
        "replicate",
        description="how the train members hold the model: replicate (each member a full "
        "copy of weights, gradients and AdamW state; gradients summed over members), or "
        "fsdp (torch FSDP2: weights and AdamW state split over the step's members, about "
        "1/k each between steps; the full weights and gradients are gathered during a "
        "step; a membership change reloads each member's shards from the committed "
        "step's torch.distributed.checkpoint state: tasks/train/sharded.py). Same "
        "updates either way; fsdp for models whose training state does not fit one cell",
    )

    @model_validator(mode="after")
    def _one_way_to_split_a_sample(self) -> TrainConfig:
        if self.sharding == "fsdp" and self.context_parallel_tokens:
            raise ValueError(
                "train.context_parallel_tokens is not combined with train.sharding=fsdp "
                "(a sharded step trains each sample whole on one member): set "
                "train.context_parallel_tokens=0, or train.sharding=replicate"
            )
        return self
