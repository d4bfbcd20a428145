"""Sampling parameters (SGLang field names) and the per-request next-token choice.

The reported logprob is that of the distribution the token was actually drawn from: the
logits divided by the temperature, cut to top-k and then to top-p, renormalised over what is
left. That is the behaviour policy's probability of the token, which is what RL needs for
importance ratios: a trainer scoring the same tokens under the same processing
(tasks/train/logprobs.py) gets ratio 1 at zero staleness. Greedy (temperature 0) takes the
argmax and reports the raw ``log_softmax(logits)[token]`` (a point mass has no useful
logprob; train greedy rollouts at temperature 1).

SGLang by default reports ``log_softmax(logits / temperature)`` *before* top-k / top-p (and the
raw one with ``SGLANG_RETURN_ORIGINAL_LOGPROB``); with top_p = 1 and no top-k the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infra.engine.errors import EngineInputError

# Fields SGLang accepts that do not change what this engine generates; accepted and ignored so
# one client payload works against both backends.
_IGNORED = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "custom_params",
    "stream_interval",
}
# Fields this engine does not implement: accepted only at their neutral value, rejected (400)
# otherwise, so a request never silently gets something other than what it asked for.
_NEUTRAL = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
}


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded output
    no_stop_trim: bool = False  # keep the matched stop string in `text`
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Validate an SGLang ``sampling_params`` dict; raise ValueError listing every problem."""
        if not isinstance(d, dict):
            raise EngineInputError("sampling_params must be a JSON object")
        errors, kw = [], {}
        for key, value in d.items():
            if key in _IGNORED or value is None:
                continue
            if key in _NEUTRAL:
                if value != _NEUTRAL[key] and value not in ({}, []):
                    errors.append(
                        f"{key}={value!r} is not supported by the embedded engine "
                        f"(only {_NEUTRAL[key]!r})"
                    )
                continue
            if key not in cls.__dataclass_fields__:
                errors.append(f"unknown sampling param {key!r}")
                continue
            try:
                kw[key] = _coerce(key, value)
            except (TypeError, ValueError) as e:
                errors.append(f"{key}={value!r}: {e}")
        if errors:
            raise EngineInputError("; ".join(errors))
        return cls(**kw)


def _coerce(key: str, value):
    def num(v, kind):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError("must be a number")
        if kind is int and int(v) != v:
            raise ValueError("must be an integer")
        return kind(v)

    if key == "max_new_tokens":
        v = num(value, int)
        if v < 1:
            raise ValueError("must be >= 1")
        return v
    if key == "min_new_tokens":
        v = num(value, int)
        if v < 0:
            raise ValueError("must be >= 0")
        return v
    if key == "temperature":
        v = num(value, float)
        if v < 0:
            raise ValueError("must be >= 0 (0 = greedy)")
        return v
    if key == "top_p":
        v = num(value, float)
        if not 0 < v <= 1:
            raise ValueError("must be in (0, 1]")
        return v
    if key == "top_k":
        v = num(value, int)
        if v < -1:
            raise ValueError("must be -1 (off) or >= 0")
        return v
    if key == "stop_token_ids":
        if not isinstance(value, list | tuple):
            raise TypeError("must be a list of token ids")
        return frozenset(num(t, int) for t in value)
    if key == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list | tuple) or not all(isinstance(x, str) for x in stops):
            raise TypeError("must be a string or a list of strings")
        return tuple(x for x in stops if x)
    if key in ("ignore_eos", "no_stop_trim"):
        if not isinstance(value, bool):
            raise TypeError("must be true or false")
        return value
    if key == "sampling_seed":
        return num(value, int)
    raise AssertionError(key)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Choose the next token from raw `logits` (V,) fp32; return (token, logprob drawn with)."""
    return sample_batch(logits.unsqueeze(0), [params], [generator])[0]


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[tuple[int, float]]:
    """Next token of each row of raw `logits` (B, V) fp32: [(token, logprob)] * B.

    The logprob is the token's under the processed distribution it was drawn from
    (temperature, top-k, top-p, renormalised); greedy rows report the raw log-softmax.

    Each sampled row is an inverse-CDF draw with one uniform from that row's own generator, so
    a seeded request's tokens depend only on its logits and seed, not on the other rows; the
    arithmetic is row-wise, one batched op per stage (3-4x cheaper than a per-row
    `torch.multinomial` at B=16).
    """
    B, V = logits.shape
    tokens = torch.argmax(logits, dim=-1)  # greedy rows keep these
    # greedy rows report the raw log-softmax; sampled rows are overwritten below
    chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    sampled = [b for b in range(B) if params[b].temperature != 0]
    if sampled:
        rows = torch.tensor(sampled)
        ps = [params[b] for b in sampled]
        temps = torch.tensor([[p.temperature] for p in ps], dtype=logits.dtype)
        scores = logits[rows] / temps
        ks = [p.top_k if 0 < p.top_k < V else 0 for p in ps]
        if any(ks):
            top = torch.topk(scores, max(ks), dim=-1).values
            kth = top[torch.arange(len(ps)), torch.tensor([max(k, 1) for k in ks]) - 1]
            kth = torch.where(torch.tensor(ks) > 0, kth, torch.full_like(kth, float("-inf")))
            scores = scores.masked_fill(scores < kth.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # what is drawn from (after temperature, top-k)
        log_q = torch.log_softmax(scores, dim=-1)  # what is reported
        u = torch.cat([torch.rand(1, generator=generators[b], dtype=probs.dtype) for b in sampled])
        nucleus = [i for i, p in enumerate(ps) if p.top_p < 1.0]
        plain = [i for i, p in enumerate(ps) if p.top_p >= 1.0]
        if plain:  # no top-p: draw from the distribution as it is
            idx = torch.tensor(plain)
            tok = _draw(probs[idx], u[idx])
            tokens[rows[idx]] = tok
            chosen[rows[idx]] = log_q[idx].gather(1, tok.unsqueeze(1)).squeeze(1)
        if nucleus:  # top-p needs the sorted distribution (a sort costs ~0.1 ms a row)
            idx = torch.tensor(nucleus)
            sorted_probs, order = torch.sort(probs[idx], dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the top token always stays)
            top_p = torch.tensor([[ps[i].top_p] for i in nucleus], dtype=probs.dtype)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
            j = _draw(sorted_probs, u[idx])
            tok = order.gather(1, j.unsqueeze(1)).squeeze(1)
            tokens[rows[idx]] = tok
            # renormalised over the nucleus: log q(tok) - log(mass kept)
            kept = torch.log(sorted_probs.sum(dim=-1))
            chosen[rows[idx]] = log_q[idx].gather(1, tok.unsqueeze(1)).squeeze(1) - kept
    return list(zip(tokens.tolist(), chosen.tolist(), strict=True))


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row of `probs` (R, V) with uniforms `u` (R,); returns (R,) ids."""
    cdf = torch.cumsum(probs, dim=-1)
    # right-sided search: index j has cdf[j] > u * total >= cdf[j-1], so p[j] > 0
    j = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    j = j.clamp(max=probs.shape[-1] - 1)
    picked = probs.gather(1, j.unsqueeze(1)).squeeze(1)
    # u * total rounded up to total: fall back to the most likely token
    return torch.where(picked > 0, j, torch.argmax(probs, dim=-1))
