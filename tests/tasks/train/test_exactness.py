"""Tree-packed training == a flat reference written here from textbook definitions.

Nothing between the records and the loss comes from the project on the reference side: it
rebuilds every call's context from the delta-encoded records, takes the branches (leaf paths;
exact duplicates once), computes advantages (group-normalised rewards, or per sub-task
attempts), drops zero-variance groups, drops or importance-weights stale tokens, and sums
PPO-clip (asymmetric eps_low / eps_high) / GRPO (symmetric) / truncated-IS (weight detached) /
k3 KL / entropy terms per branch and token, divided by the per-token mean normaliser (trained
tokens summed over branches). Log-probs are those of the distribution sampled from
(temperature, top-k, top-p renormalised). The project's side is the real path:
build_trees -> build_samples -> Trainer.loss_and_grads (packing, partitions of large trees,
tree or dense attention). float64: loss and every parameter gradient agree to ~1e-12, on each
architecture family (Qwen3, Llama as SmolLM2, Qwen2).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tasks.train.packed_loss import keep_norms_in_fp64
from tasks.train.trainer import Trainer
from tasks.trajectory.sampler import build_samples
from tasks.trajectory.scoring import Score
from tasks.trajectory.synth import random_session
from tasks.trajectory.tree import build_trees
from tests.models import ARCHS, micro_config

VOCAB = 40
EPS = 1e-6  # the documented advantage epsilon: (R - mean) / (std + 1e-6)
N_CASES = 24


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _save_model(path: Path, seed: int, arch: str) -> str:
    torch.manual_seed(seed)
    cfg = micro_config(arch, VOCAB)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float64)
    with torch.no_grad():  # logits far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=ARCHS)
def model_dirs(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(f"exact-{arch}")
    return _save_model(d / "policy", 0, arch), _save_model(d / "reference", 1, arch)


def load(path: str) -> torch.nn.Module:
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    keep_norms_in_fp64(m)
    return m


# ---- the random case ---------------------------------------------------------------------


@dataclass
class Case:
    records: list = field(default_factory=list)
    spans: dict = field(default_factory=dict)
    parents: dict = field(default_factory=dict)  # sub-agent session -> spawning session
    rewards: dict = field(default_factory=dict)  # root session -> reward
    groups: dict = field(default_factory=dict)
    scores: list = field(default_factory=list)
    advantage: str = "grpo"
    normalize_std: bool = True
    loss: str = "ppo_clip"
    eps_low: float = 0.2
    eps_high: float = 0.28
    is_cap: float = 2.0
    current_version: int = 0
    max_staleness: int = 0
    stale_policy: str = "drop"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    max_tokens: int = 4096
    attention: str = "tree"


def _nan_out(records, spans):
    """Make some behaviour logprobs NaN (a backend that did not return them), as a function
    of (token prefix, version) so that every copy of a shared token agrees."""
    paths = contexts(records, spans)
    out = []
    for r in records:
        tok = paths[r.request_id][0]
        n = len(tok) - len(r.output_ids)
        lps = list(r.output_logprobs)
        for j in range(len(lps)):
            key = np.asarray(tok[: n + j + 1], np.int32).tobytes() + bytes([r.weight_version])
            if zlib.crc32(key) % 6 == 0:
                lps[j] = math.nan
        out.append(replace(r, output_logprobs=lps))
    return out


def make_case(seed: int) -> Case:
    rng = np.random.default_rng(seed)
    c = Case()
    c.advantage = ["grpo", "per_subtask"][seed % 2]
    c.loss = ["ppo_clip", "grpo", "ppo_clip", "tis"][(seed // 2) % 4]
    c.normalize_std = bool(rng.random() < 0.8)
    c.eps_low, c.eps_high = float(rng.choice([0.1, 0.2])), float(rng.choice([0.28, 0.4]))
    c.is_cap = float(rng.choice([1.5, 2.0]))
    c.temperature = float(rng.choice([1.0, 0.7, 1.3]))
    c.top_p = float(rng.choice([1.0, 1.0, 0.9]))
    c.top_k = int(rng.choice([-1, -1, 12]))
    c.kl_coef = float(rng.choice([0.0, 0.1]))
    c.entropy_coef = float(rng.choice([0.0, 0.05]))
    c.attention = ["tree", "dense"][int(rng.random() < 0.25)]
    for g in range(int(rng.integers(2, 4))):
        flat = rng.random() < 0.3  # a zero-variance group
        base = float(rng.choice([0.0, 0.5, 1.0]))
        const_scores = rng.choice([0.0, 0.5, 1.0], size=3)
        for i in range(int(rng.integers(2, 5))):
            sid = f"g{g}s{i}"
            c.groups[sid] = f"g{g}"
            c.rewards[sid] = base if flat else float(rng.choice([0.0, 0.25, 0.5, 1.0]))
            if rng.random() < 0.12:  # a rollout that made no call still shapes the baseline
                continue
            recs, sp = random_session(
                rng,
                n_calls=int(rng.integers(2, 9)),
                session_id=sid,
                vocab=VOCAB,
                p_retry=0.25,
                p_reset=0.15,
                p_dup=0.15,
                p_tool=0.5,
                p_version_bump=0.35,
            )
            c.records += recs
            c.spans |= sp
            rids = [r.request_id for r in recs]
            for j in range(3):  # sub-task reports: retries, unreached, not tied to a call
                if flat:
                    at = str(rng.choice(rids)) if rng.random() < 0.5 else None
                    c.scores.append(Score("run", sid, f"t{j}", float(const_scores[j]), 1.0, at))
                    continue
                for _ in range(int(rng.choice([0, 1, 1, 2, 3]))):
                    at = str(rng.choice(rids)) if rng.random() < 0.85 else None
                    sc = float(rng.choice([0.0, 0.5, 1.0]))
                    c.scores.append(Score("run", sid, f"t{j}", sc, float(1 + j % 2), at))
            if rng.random() < 0.3:  # a sub-agent this rollout spawned
                sub = f"{sid}-sub"
                srecs, ssp = random_session(
                    rng, n_calls=int(rng.integers(1, 5)), session_id=sub, vocab=VOCAB
                )
                c.records += srecs
                c.spans |= ssp
                c.parents[sub] = sid
    c.records = _nan_out(c.records, c.spans)
    vmax = max(r.weight_version for r in c.records)
    c.current_version = vmax + int(rng.integers(0, 2))
    # tokens both at the bound (kept) and just below it (dropped / importance-weighted)
    min_version = int(rng.integers(1, max(2, (vmax + 3) // 2))) if vmax >= 1 else 0
    c.max_staleness = c.current_version - min_version
    c.stale_policy = ["drop", "is"][int(rng.random() < 0.5)]
    depth = max(len(p[0]) for p in contexts(c.records, c.spans).values())
    c.max_tokens = depth + int(rng.integers(1, 25))  # small: large trees are partitioned
    return c


# ---- the reference -------------------------------------------------------------------------


def contexts(records, spans):
    """request id -> (tokens, provenance, version, behaviour logprob) lists of its input +
    output, rebuilt from the delta encoding: parent's context[:prefix_len] + new + output."""
    out: dict[str, tuple[list, list, list, list]] = {}
    for r in sorted(records, key=lambda r: (r.session_id, r.seq_no)):
        if r.parent_request_id is None:
            tok, prov, ver, lp = [], [], [], []
        else:
            tok, prov, ver, lp = (x[: r.prefix_len] for x in out[r.parent_request_id])
        new_prov = ["harness"] * len(r.new_input_ids)
        for lo, hi, name in spans.get(r.request_id, []):
            new_prov[lo:hi] = [name] * (hi - lo)
        n_out = len(r.output_ids)
        out[r.request_id] = (
            tok + [int(t) for t in r.new_input_ids] + [int(t) for t in r.output_ids],
            prov + new_prov + ["policy"] * n_out,
            ver + [-1] * len(r.new_input_ids) + [int(r.weight_version)] * n_out,
            # logprobs are float32 in TITO (storage/schemas.py), as the tree keeps them
            lp
            + [math.nan] * len(r.new_input_ids)
            + [float(np.float32(x)) for x in r.output_logprobs],
        )
    return out


def normalised(xs, normalize_std):
    """GRPO normalisation: (x - mean) / (population std + eps); all equal -> all 0."""
    if max(xs) == min(xs):
        return [0.0] * len(xs)
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return [(x - mean) / (std + EPS) if normalize_std else x - mean for x in xs]


def reference_branches(c: Case):
    """[(session, path key, advantage)] of every branch that trains, and the filtered groups."""
    ctx = contexts(c.records, c.spans)
    key = {rid: tuple(zip(t, p, v, strict=True)) for rid, (t, p, v, _) in ctx.items()}
    by_session: dict[str, list[str]] = {}
    for r in sorted(c.records, key=lambda r: r.seq_no):
        by_session.setdefault(r.session_id, []).append(r.request_id)

    def root(sid):
        while sid in c.parents:
            sid = c.parents[sid]
        return sid

    members: dict[str, list[str]] = {}
    for sid in c.rewards:
        members.setdefault(c.groups[sid], []).append(sid)
    adv: dict[str, float] = {}  # root session -> advantage (grpo) / final credit (sub-agents)
    attempts: dict[str, list] = {}  # root -> [(subtask, at, order, term)]
    flat_groups = set()
    for gid, sids in members.items():
        if c.advantage == "grpo":
            a = normalised([c.rewards[s] for s in sids], c.normalize_std)
            adv |= dict(zip(sids, a, strict=True))
            if all(x == 0 for x in a):
                flat_groups.add(gid)
            continue
        located = {s: {} for s in sids}  # s -> subtask -> at -> (order, score)
        latest = {s: {} for s in sids}
        for i, sc in enumerate(c.scores):
            if sc.session_id in located:
                located[sc.session_id].setdefault(sc.subtask_id, {})[sc.at_request_id] = (i, sc)
                latest[sc.session_id][sc.subtask_id] = sc
        norm = {}
        signal = False
        for j in sorted({j for s in sids for j in located[s]}):
            slots, xs = [], []
            for s in sids:
                reps = located[s].get(j, {None: (None, None)})
                for at, (_, sc) in reps.items():
                    slots.append((s, at))
                    xs.append(sc.score if sc is not None else 0.0)
            vals = normalised(xs, c.normalize_std)
            signal |= any(v != 0 for v in vals)
            norm |= {(s, j, at): v for (s, at), v in zip(slots, vals, strict=True)}
        if not signal:
            flat_groups.add(gid)
        for s in sids:
            tw = sum(sc.weight for sc in latest[s].values())
            share = {j: sc.weight / tw if tw else 0.0 for j, sc in latest[s].items()}
            attempts[s] = [
                (j, at, order, share[j] * norm[(s, j, at)])
                for j, reps in located[s].items()
                for at, (order, _) in reps.items()
            ]
            adv[s] = sum(share[j] * norm[(s, j, sc.at_request_id)] for j, sc in latest[s].items())

    out = []
    for sid, rids in by_session.items():
        own = root(sid)
        if c.groups[own] in flat_groups:
            continue
        uniq: dict[tuple, str] = {}
        for rid in rids:
            uniq.setdefault(key[rid], rid)
        for k, rid in uniq.items():
            if any(len(o) > len(k) and o[: len(k)] == k for o in uniq):
                continue  # another call extends this path: not a leaf
            if c.advantage == "grpo" or sid != own:
                a = adv[own]
            else:  # per sub-task: the deepest attempt of each sub-task on this path
                best = {}
                for j, at, order, term in attempts[own]:
                    depth = -1 if at is None else len(key[at])
                    if at is not None and key[at] != k[:depth]:
                        continue
                    if j not in best or (depth, order) > best[j][:2]:
                        best[j] = (depth, order, term)
                a = sum(t for _, _, t in best.values())
            out.append((sid, rid, a))
    return out, flat_groups


def log_q(z: torch.Tensor, tok: int, c: Case):
    """log-prob and entropy of the distribution sampled from: z / T, top-k, top-p, renormalised."""
    s = z / c.temperature
    vals = s.detach().tolist()
    order = sorted(range(len(vals)), key=lambda i: -vals[i])
    keep = set(range(len(vals)))
    if 0 < c.top_k < len(vals):
        kth = vals[order[c.top_k - 1]]
        keep = {i for i in keep if vals[i] >= kth}
    if c.top_p < 1:
        m = max(vals[i] for i in keep)
        w = {i: math.exp(vals[i] - m) for i in keep}
        total = sum(w.values())
        mass, nucleus = 0.0, set()
        for i in order:
            if i in keep:
                if mass < c.top_p:
                    nucleus.add(i)
                mass += w[i] / total
        keep = nucleus
    keep.add(tok)
    idx = torch.tensor(sorted(keep))
    lse = torch.logsumexp(s[idx], 0)
    lq = s[idx] - lse
    return s[tok] - lse, -(lq.exp() * lq).sum()


def reference_loss(c: Case, model, ref_model) -> tuple[torch.Tensor, dict]:
    ctx = contexts(c.records, c.spans)
    branches, flat_groups = reference_branches(c)
    min_version = c.current_version - c.max_staleness
    lo, hi = (c.eps_low, c.eps_low) if c.loss == "grpo" else (c.eps_low, c.eps_high)
    total = torch.zeros((), dtype=torch.float64)
    n_norm = 0
    stats = {"stale_is": 0, "dropped": 0, "boundary": 0, "pos": 0, "neg": 0, "nan": 0}
    for _, rid, a in branches:
        tok, prov, ver, blp = ctx[rid]
        stats["pos" if a > 0 else "neg" if a < 0 else "zero"] = 1
        train = []
        for i in range(1, len(tok)):
            if prov[i] != "policy":
                continue
            if math.isnan(blp[i]):
                stats["nan"] += 1
                continue
            if c.stale_policy == "drop" and ver[i] < min_version:
                stats["dropped"] += 1
                continue
            stats["boundary"] += ver[i] == min_version
            train.append(i)
        n_norm += len(train)
        if not train:
            continue
        ids = torch.tensor([tok])
        logits = model(input_ids=ids).logits[0]
        ref_logits = ref_model(input_ids=ids).logits[0] if c.kl_coef else None
        for i in train:
            lp, ent = log_q(logits[i - 1], tok[i], c)
            r = torch.exp(lp - blp[i])
            if c.loss == "tis" or (c.stale_policy == "is" and ver[i] < min_version):
                stats["stale_is"] += c.loss != "tis"
                term = -torch.clamp(r, max=c.is_cap).detach() * a * lp
            else:
                term = -torch.minimum(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)
            if c.kl_coef:
                with torch.no_grad():
                    ref_lp, _ = log_q(ref_logits[i - 1], tok[i], c)
                d = ref_lp - lp
                term = term + c.kl_coef * (torch.exp(d) - d - 1)
            if c.entropy_coef:
                term = term - c.entropy_coef * ent
            total = total + term
    stats["filtered"] = len(flat_groups)
    stats["branches"] = len(branches)
    return total / (n_norm or 1), stats


# ---- the comparison ------------------------------------------------------------------------


def project_loss(c: Case, policy_dir: str, ref_dir: str, *, context_parallel: bool = False):
    """The project's loss and gradients on the case (``context_parallel``: every sample
    trained as a slice of this process's share of the default torch.distributed group)."""
    trees = build_trees(c.records, session_parents=c.parents, spans=c.spans)
    samples = build_samples(
        trees,
        c.rewards,
        c.groups,
        advantage=c.advantage,
        scores=c.scores if c.advantage == "per_subtask" else None,
        normalize_std=c.normalize_std,
        current_version=c.current_version,
        max_staleness=c.max_staleness,
        stale_policy=c.stale_policy,
    )
    tr = Trainer(
        policy_dir,
        loss=c.loss,
        clip_eps_low=c.eps_low,
        clip_eps_high=c.eps_high,
        is_cap=c.is_cap,
        max_tokens_per_micro=c.max_tokens,
        dtype=torch.float64,
        max_staleness=c.max_staleness if c.stale_policy == "is" else None,
        attention=c.attention,
        temperature=c.temperature,
        top_p=c.top_p,
        top_k=c.top_k,
        kl_coef=c.kl_coef,
        entropy_coef=c.entropy_coef,
        ref_model_dir=ref_dir,
    )
    tr.model.zero_grad(set_to_none=True)
    if context_parallel:
        m = tr.loss_and_grads(
            [],
            current_version=c.current_version,
            normalizer=float(sum(s.n_flat_trainable for s in samples)) or 1.0,
            cp_samples=samples,
        )
    else:
        m = tr.loss_and_grads(samples, current_version=c.current_version)
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    return m, grads, samples


@pytest.mark.parametrize("seed", range(N_CASES))
def test_tree_training_equals_textbook_flat_reference(seed, model_dirs):
    c = make_case(seed)
    policy_dir, ref_dir = model_dirs
    m, tree_grads, samples = project_loss(c, policy_dir, ref_dir)
    model, ref_model = load(policy_dir), load(ref_dir)
    loss, stats = reference_loss(c, model, ref_model)
    if loss.requires_grad:
        loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    loss_value = float(loss.detach())
    assert abs(m["loss"] - loss_value) <= 1e-12, (m["loss"], loss_value, stats)
    assert tree_grads.keys() == ref_grads.keys()
    if ref_grads:
        diff = max(float((tree_grads[k] - ref_grads[k]).abs().max()) for k in ref_grads)
        scale = max(float(ref_grads[k].abs().max()) for k in ref_grads)
        assert diff <= 1e-12 * max(1.0, scale), (diff, scale, stats)
    COVERAGE[seed] = stats | {
        "micro_batches": m["micro_batches"],
        "pieces": m["micro_batches"] > 1 and any(s.n_tokens > c.max_tokens for s in samples),
        "loss_nonzero": abs(loss_value) > 1e-6,
    }


COVERAGE: dict[int, dict] = {}


def test_the_random_cases_cover_what_they_must():
    """The cases above exercise every rule (runs after them; skipped when run alone)."""
    if len(COVERAGE) < N_CASES:
        pytest.skip("run with the parametrised cases")
    total = {k: sum(float(s.get(k, 0)) for s in COVERAGE.values()) for k in COVERAGE[0]}
    for k in ("stale_is", "dropped", "boundary", "nan", "filtered", "pieces", "pos", "neg"):
        assert total[k] > 0, (k, total)
    assert total["loss_nonzero"] >= N_CASES - 2
