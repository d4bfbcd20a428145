"""Planted bugs in the learning code: each is one exact source edit and the tests it must fail.

A mutant is a plausible mistake (an off-by-one, a sign, a dropped ``.detach()``, a skipped
filter, the wrong constant), not a syntax error. ``old`` must occur exactly once in ``path``;
the runner refuses a mutant that no longer applies, so the list cannot rot silently when the
code moves. The first eleven are the bugs issue 10 reported as passing every test; the glue
section (the code around the maths: clipping, DP, weight sync, evaluation, sampling settings,
retries, commits) starts with the seven issue 15 reported as passing every fast test.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str = ""


T = "tests/tasks/train/"
# the fast hand-made tests first: -x stops at the first failure
LOSSES = (T + "test_losses.py", T + "test_exactness.py", T + "test_tree_train.py")
TRAIN = (T + "test_packing.py", T + "test_exactness.py", T + "test_tree_train.py")
LOGP = (T + "test_logprobs.py", T + "test_exactness.py")
TRAJ = ("tests/tasks/trajectory", T + "test_exactness.py")
SFT = (T + "test_sft.py",)
ENGINE = ("tests/infra/engine/test_sampling.py", T + "test_logprobs.py")
# the glue's fast tests (tests that pin behaviour against a plain reference computed in the test)
G_TRAIN = (T + "test_trainer_glue.py",)
G_DP = ("tests/tasks/test_dp_step.py",)
G_SYNC = ("tests/infra/cells/test_weight_sync.py",)
G_EVAL = ("tests/tasks/test_evaluate.py",)
G_RETRY = ("tests/tasks/env/test_retry_credit.py",)
G_ROLL = ("tests/tasks/test_rollout_sampling.py",)
G_COMMIT = ("tests/storage/test_commits.py", "tests/storage/test_store.py")

S = "tasks/trajectory/sampler.py"
L = "tasks/train/losses.py"
PL = "tasks/train/packed_loss.py"
TR = "tasks/train/trainer.py"
PK = "tasks/train/packing.py"
LP = "tasks/train/logprobs.py"

MUTANTS: list[Mutant] = [
    # ---- the eleven of issue 10 ----
    Mutant(
        "staleness bound ignored",
        S,
        "    if min_version is not None:\n        trainable &= ft.versions >= min_version",
        "    if False:\n        trainable &= ft.versions >= min_version",
        TRAJ,
    ),
    Mutant(
        "staleness bound off by one (sampler)",
        S,
        "trainable &= ft.versions >= min_version",
        "trainable &= ft.versions > min_version",
        TRAJ,
    ),
    Mutant(
        "staleness bound off by one (trainer)",
        TR,
        "min_version = version - self.max_staleness if",
        "min_version = version - self.max_staleness - 1 if",
        TRAIN,
    ),
    Mutant(
        "truncated-IS weight not detached",
        L,
        "coef = torch.clamp(_ratio(logp, behaviour_logp), max=cap).detach()",
        "coef = torch.clamp(_ratio(logp, behaviour_logp), max=cap)",
        LOSSES,
    ),
    Mutant(
        "grpo uses the asymmetric clip",
        PL,
        "            return self.eps_low, self.eps_low",
        "            return self.eps_low, self.eps_high",
        LOSSES,
    ),
    Mutant(
        "wrong normaliser (unique instead of flat tokens)",
        TR,
        "normalizer = float(sum(s.n_flat_trainable for s in samples)) or 1.0",
        "normalizer = float(sum(s.n_trainable for s in samples)) or 1.0",
        TRAIN,
    ),
    Mutant(
        "NaN behaviour logprobs trained",
        S,
        "(ft.provenance == POLICY) & ~np.isnan(ft.logprobs) & (ft.parent_idx >= 0)",
        "(ft.provenance == POLICY) & (ft.parent_idx >= 0)",
        TRAJ,
    ),
    Mutant(
        "a sub-agent tree gets advantage 0",
        S,
        'session_adv = float(rewards[own]) if advantage == "reward" else adv[own]',
        'session_adv = float(rewards[own]) if advantage == "reward" else '
        "(adv[own] if own == sid else 0.0)",
        TRAJ,
    ),
    Mutant(
        "std normalisation ignored in per-sub-task advantages",
        S,
        "a = _normalise(np.array(xs, dtype=np.float64), normalize_std=normalize_std, eps=eps)",
        "a = _normalise(np.array(xs, dtype=np.float64), normalize_std=False, eps=eps)",
        TRAJ,
    ),
    Mutant(
        "a partition trains the repeated ancestor path twice",
        PK,
        "    wp[:n_repeat] = 0.0\n    wn[:n_repeat] = 0.0\n    cnt[:n_repeat] = 0\n",
        "",
        TRAIN,
    ),
    Mutant(
        "the truncated-IS routing of stale tokens ignored",
        L,
        "        loss = torch.where(is_mask, tis, loss)",
        "        loss = loss",
        LOSSES,
    ),
    # ---- losses ----
    Mutant(
        "clip high side uses eps_low",
        L,
        "weight_pos * torch.clamp(r, max=1.0 + eps_high)",
        "weight_pos * torch.clamp(r, max=1.0 + eps_low)",
        LOSSES,
    ),
    Mutant(
        "negative advantages unclipped",
        L,
        "+ weight_neg * torch.clamp(r, min=1.0 - eps_low)",
        "+ weight_neg * r",
        LOSSES,
    ),
    Mutant(
        "truncated-IS cap ignored",
        L,
        "max=cap).detach()",
        "max=1e9).detach()",
        LOSSES,
    ),
    Mutant("KL k1 instead of k3", L, "return torch.exp(d) - d - 1.0", "return -d", LOSSES),
    Mutant(
        "KL sign flipped",
        L,
        "out = out + kl_coef * count * kl",
        "out = out - kl_coef * count * kl",
        LOSSES,
    ),
    Mutant(
        "entropy bonus sign flipped",
        L,
        "out = out - entropy_coef * count * entropy",
        "out = out + entropy_coef * count * entropy",
        LOSSES,
    ),
    Mutant(
        "KL counted once per token, not per branch",
        L,
        "out = out + kl_coef * count * kl",
        "out = out + kl_coef * kl",
        LOSSES,
    ),
    Mutant(
        "clip fraction ignores which side carries weight",
        L,
        "clipped = ((r > 1.0 + eps_high) & (weight_pos > 0)) | (",
        "clipped = (r > 1.0 + eps_high) | (",
        LOSSES,
    ),
    # ---- packed loss, trainer, logprobs ----
    Mutant(
        "truncated-IS mask off by one",
        PL,
        "(versions >= 0) & (versions < min_version)",
        "(versions >= 0) & (versions <= min_version)",
        TRAIN,
    ),
    Mutant(
        "token predicted from its own hidden state",
        PL,
        "rows = torch.as_tensor(packed.parent_idx[sel], device=device)",
        "rows = torch.as_tensor(sel, device=device)",
        TRAIN,
    ),
    Mutant(
        "KL reference is the policy itself",
        PL,
        "ref_logp, _ = stats(ref_model, False)",
        "ref_logp, _ = stats(model, False)",
        TRAIN,
    ),
    Mutant(
        "zero-advantage tokens get no KL / entropy",
        PL,
        "np.flatnonzero(((counts > 0) | (wp != 0) | (wn != 0)) & (parent >= 0))",
        "np.flatnonzero(((wp != 0) | (wn != 0)) & (parent >= 0))",
        TRAIN,
    ),
    Mutant("temperature ignored by the trainer", LP, "x = x / dist.temperature", "x = x", LOGP),
    Mutant("top-p ignored by the trainer", LP, "if dist.top_p < 1.0:", "if False:", LOGP),
    Mutant(
        "top-k drops the k-th token",
        LP,
        "keep = x >= kth",
        "keep = x > kth",
        LOGP,
    ),
    Mutant(
        "entropy sign flipped in the trainer's distribution",
        LP,
        "return logp, -(lsm.exp() * finite).sum(-1)",
        "return logp, (lsm.exp() * finite).sum(-1)",
        LOGP,
    ),
    Mutant(
        "a sampled token outside the trainer's nucleus becomes impossible",
        LP,
        "keep[torch.arange(n, device=x.device), targets] = True",
        "pass",
        LOGP,
    ),
    # ---- packing, tree attention ----
    Mutant(
        "collated parents not shifted",
        PK,
        "np.where(p.parent_idx >= 0, p.parent_idx.astype(np.int64) + o, -1)",
        "np.where(p.parent_idx >= 0, p.parent_idx.astype(np.int64), -1)",
        TRAIN,
    ),
    Mutant(
        "a piece misses the root of its ancestor path",
        PK,
        "anc = ancestors(sample.parent_idx, a, rs)",
        "anc = ancestors(sample.parent_idx, a, rs)[1:]",
        TRAIN,
    ),
    Mutant(
        "dense ancestor mask drops the parent",
        PK,
        "mask[i:j, :] = mask[p]",
        "mask[i:j, :p] = mask[p, :p]",
        TRAIN,
    ),
    Mutant(
        "tree attention: a token does not see itself",
        "tasks/train/tree_attention.py",
        "depth + lo - s)\n        for lo in",
        "depth + lo - s - 1)\n        for lo in",
        TRAIN,
    ),
    Mutant(
        "tree attention: a chain's path misses its parent token",
        "tasks/train/tree_attention.py",
        "path = np.concatenate([paths[pc], np.arange(starts[pc], p + 1)])",
        "path = np.concatenate([paths[pc], np.arange(starts[pc], p)])",
        TRAIN,
    ),
    # ---- sampler ----
    Mutant(
        "grpo std normalisation ignored",
        S,
        "_normalise(r, normalize_std=normalize_std, eps=eps)",
        "_normalise(r, normalize_std=False, eps=eps)",
        TRAJ,
    ),
    Mutant(
        "grpo baseline over all rollouts, not the group",
        S,
        "    for sids in _members(rewards, groups).values():\n        r = np.array",
        "    for sids in [list(rewards)]:\n        r = np.array",
        TRAJ,
    ),
    Mutant(
        "zero-variance groups not filtered",
        S,
        "skip = set(flat_groups) if filter_zero_variance else set()",
        "skip = set()",
        TRAJ,
    ),
    Mutant(
        "a root token is trainable",
        S,
        "(ft.provenance == POLICY) & ~np.isnan(ft.logprobs) & (ft.parent_idx >= 0)",
        "(ft.provenance == POLICY) & ~np.isnan(ft.logprobs)",
        TRAJ,
    ),
    Mutant(
        "negative advantages added to the positive part",
        S,
        "        elif ab < 0:\n            neg[e] += ab",
        "        elif ab < 0:\n            pos[e] += ab",
        TRAJ,
    ),
    Mutant(
        "a shared prefix gets only one branch's weight",
        S,
        "            pos[p] += pos[i]\n",
        "",
        TRAJ,
    ),
    Mutant(
        "normaliser counts each unique token once",
        S,
        "counts = np.where(trainable, tok_cnt, 0).astype(np.int32)",
        "counts = np.where(trainable, 1, 0).astype(np.int32)",
        TRAJ,
    ),
    Mutant(
        "per-sub-task credit given to every branch",
        S,
        "            if node >= 0 and not ft.is_ancestor_or_self(node, end):\n"
        "                continue  # earned on another branch",
        "            if False:\n                continue",
        TRAJ,
    ),
    Mutant(
        "per-sub-task: only the latest report counts (a worse retry not blamed)",
        S,
        "located[sc.session_id].setdefault(sc.subtask_id, {})[sc.at_request_id] = (i, sc)",
        "located[sc.session_id][sc.subtask_id] = {sc.at_request_id: (i, sc)}",
        TRAJ,
    ),
    Mutant(
        "per-sub-task: the shallowest attempt on the path wins",
        S,
        "key[:2] > best[att.subtask][:2]",
        "key[:2] < best[att.subtask][:2]",
        TRAJ,
    ),
    Mutant(
        "a score at an unknown request id accepted",
        S,
        "        _check_locations(score_list, tree_map, rewards)\n",
        "",
        TRAJ,
    ),
    Mutant(
        "pruning drops a needed ancestor",
        S,
        "cut = np.where(below, ft.node_offset + ft.node_length - 1, last)",
        "cut = last",
        TRAJ,
    ),
    Mutant(
        "per-sub-task weights not normalised over the rollout's sub-tasks",
        S,
        "share = {j: (sc.weight / tw if tw > 0 else 0.0) for j, sc in latest[sid].items()}",
        "share = {j: sc.weight for j, sc in latest[sid].items()}",
        TRAJ,
    ),
    Mutant(
        "a sub-agent of a zero-variance group still trains",
        S,
        "if groups.get(own, own) in skip:",
        "if groups.get(sid, sid) in skip:",
        TRAJ,
    ),
    Mutant(
        "per-sub-task zero-variance groups never detected",
        S,
        "signal |= bool(np.any(a != 0))",
        "signal = True",
        TRAJ,
    ),
    # ---- tree, layout, scoring ----
    Mutant(
        "layout: a node's first token hangs off its parent's first token",
        "tasks/trajectory/layout.py",
        "offset[np.maximum(node_parent, 0)] + length[np.maximum(node_parent, 0)] - 1,",
        "offset[np.maximum(node_parent, 0)],",
        TRAJ,
    ),
    Mutant(
        "layout: positions are preorder indices, not depths",
        "tasks/trajectory/layout.py",
        "positions = np.repeat(starts - offset, length) + idx",
        "positions = idx",
        TRAJ,
    ),
    Mutant(
        "tree: tokens of different policy versions share a node",
        "tasks/trajectory/tree.py",
        "if node.prov == prov and node.version == version:",
        "if node.prov == prov:",
        TRAJ,
    ),
    Mutant(
        "scoring: weighted mean ignores the weights",
        "tasks/trajectory/scoring.py",
        "return sum(s.weight * s.score for s in scores) / tw if tw > 0 else 0.0",
        "return sum(s.score for s in scores) / len(scores) if scores else 0.0",
        TRAJ,
    ),
    Mutant(
        "scoring: the first report of a sub-task wins",
        "tasks/trajectory/scoring.py",
        "            latest[s.subtask_id] = s\n",
        "            latest.setdefault(s.subtask_id, s)\n",
        TRAJ,
    ),
    # ---- supervised warm start ----
    Mutant(
        "warm start: the prompt tokens are targets too",
        "tasks/train/sft.py",
        "target += [False] * len(context) + [True] * len(said)",
        "target += [True] * len(context) + [True] * len(said)",
        SFT,
    ),
    Mutant(
        "warm start: the end-of-turn token is not learnt",
        "tasks/train/sft.py",
        "reply = reply[: cut + len(end)] if cut >= 0 else reply",
        "reply = reply[:cut] if cut >= 0 else reply",
        SFT,
    ),
    Mutant(
        "warm start: the target mask is shifted by one",
        "tasks/train/sft.py",
        "return -lp[torch.as_tensor(target[1:], device=device)].sum()",
        "return -lp[torch.as_tensor(target[:-1], device=device)].sum()",
        SFT,
    ),
    # ---- the engine's reported logprob ----
    Mutant(
        "engine reports the raw (untempered) logprob",
        "infra/engine/sampling.py",
        "log_q = torch.log_softmax(scores, dim=-1)  # what is reported",
        "log_q = torch.log_softmax(logits[rows], dim=-1)  # what is reported",
        ENGINE,
    ),
    Mutant(
        "engine top-k drops the k-th token",
        "infra/engine/sampling.py",
        'scores = scores.masked_fill(scores < kth.unsqueeze(1), float("-inf"))',
        'scores = scores.masked_fill(scores <= kth.unsqueeze(1), float("-inf"))',
        ENGINE,
    ),
    Mutant(
        "engine does not renormalise over the nucleus",
        "infra/engine/sampling.py",
        "chosen[rows[idx]] = log_q[idx].gather(1, tok.unsqueeze(1)).squeeze(1) - kept",
        "chosen[rows[idx]] = log_q[idx].gather(1, tok.unsqueeze(1)).squeeze(1)",
        ENGINE,
    ),
    # ---- the glue: the seven of issue 15 ----
    Mutant(
        "gradient clipping silently off",
        TR,
        "max_norm = self.max_grad_norm if self.max_grad_norm is not None else math.inf",
        "max_norm = math.inf",
        G_TRAIN,
    ),
    Mutant(
        "a DP member normalises by its own shard",
        "tasks/train_step.py",
        "normalizer = float(sum(s.n_flat_trainable for s in train_on)) or 1.0",
        "normalizer = float(sum(s.n_flat_trainable for s in mine)) or 1.0",
        G_DP,
    ),
    Mutant(
        "DP gradients averaged, not summed",
        "tasks/train/dp.py",
        "        flat = self._all_reduce(flat)\n",
        "        flat = self._all_reduce(flat) / self.world\n",
        G_DP,
    ),
    Mutant(
        "weight sync loads the previous checkpoint under the new label",
        "infra/cells/engines.py",
        "path = fetch_checkpoint(store, run_id, version)",
        "path = fetch_checkpoint(store, run_id, max(version - 1, 0))",
        G_SYNC,
    ),
    Mutant(
        "held-out evaluation samples instead of greedy",
        "tasks/evaluate.py",
        "        temperature=0.0,\n",
        "        temperature=rollout.temperature,\n",
        G_EVAL,
    ),
    Mutant(
        "trainer temperature not taken from the rollout (run config)",
        "flows/config.py",
        'train["temperature"] = float(t) if isinstance(t, int | float) and t > 0 else 1.0',
        'train["temperature"] = 1.0',
        G_TRAIN,
    ),
    Mutant(
        "per-sub-task credit: a retry takes the credit of a better first attempt",
        "tasks/env/arith.py",
        'if res.status != "finished" or score > res.score:',
        "if True:",
        G_RETRY,
    ),
    # ---- the glue: more of that kind ----
    Mutant(
        "trainer temperature not taken from the train section",
        "tasks/train_step.py",
        '"temperature": cfg.temperature if cfg.temperature is not None else 1.0,',
        '"temperature": 1.0,',
        G_TRAIN,
    ),
    Mutant(
        "trainer top-p not taken from the train section",
        "tasks/train_step.py",
        '"top_p": cfg.top_p if cfg.top_p is not None else 1.0,',
        '"top_p": 1.0,',
        G_TRAIN,
    ),
    Mutant(
        "trainer top-p not taken from the rollout (run config)",
        "flows/config.py",
        'train["top_p"] = rollout.get("top_p", RolloutConfig.model_fields["top_p"].default)',
        'train["top_p"] = 1.0',
        G_TRAIN,
    ),
    Mutant(
        "DP gradients never reduced",
        TR,
        "            reduce_grads(self.model)\n",
        "            pass\n",
        G_DP,
    ),
    Mutant(
        "every DP member trains the whole batch",
        "tasks/train_step.py",
        "mine = [train_on[i] for i in parts[rank]]",
        "mine = list(train_on)",
        G_DP,
    ),
    Mutant(
        "DP metrics not summed over members",
        "tasks/train/dp.py",
        "        for k, v in zip(keys, vec.tolist(), strict=False):\n            out[k] = v\n",
        "",
        G_DP,
    ),
    Mutant(
        "DP shard ignores the loads (all to one member)",
        "tasks/train/dp.py",
        "        loads[r] += sizes[i]\n",
        "",
        ("tests/tasks/test_dp.py", *G_DP),
    ),
    Mutant(
        "engine keeps the old model on a weight load",
        "infra/engine/engine.py",
        "            self.model = model\n",
        "",
        G_SYNC,
    ),
    Mutant(
        "engine keeps the old version label on a weight load",
        "infra/engine/engine.py",
        "            self._weight_version = version\n",
        "",
        G_SYNC,
    ),
    Mutant(
        "held-out evaluation keeps the rollout's retries",
        "tasks/evaluate.py",
        "        max_attempts=cfg.max_attempts,\n",
        "",
        G_EVAL,
    ),
    Mutant(
        "harness: the last attempt of a turn is not kept as history",
        "tasks/env/harness.py",
        "score >= s.retry_below or attempt == s.max_attempts - 1:",
        "score >= s.retry_below or attempt == s.max_attempts:",
        G_RETRY,
    ),
    Mutant(
        "resumed trainer loses its optimizer state",
        TR,
        "            t.optimizer.load_state_dict(sd)\n",
        "",
        G_TRAIN,
    ),
    Mutant(
        "step committed under the start version's label",
        "tasks/train_step.py",
        "    version = trainer.version\n    if staged is not None:",
        "    version = start_version\n    if staged is not None:",
        G_DP,
    ),
    Mutant(
        "ledger refuses another run's samples",
        "tasks/train_step.py",
        "        if rid == run_id\n",
        "        if rid != run_id\n",
        ("tests/tasks/test_process_train.py",),
    ),
    Mutant(
        "a commit writes no ledger rows",
        "storage/commits.py",
        '    store.append("ledger", ledger_rows)\n',
        "",
        G_COMMIT,
    ),
    Mutant(
        "roll forward skips the newest committed step",
        "storage/commits.py",
        "        if v <= top:\n",
        "        if v <= top + 1:\n",
        G_COMMIT,
    ),
    Mutant(
        "a resumed run continues from the oldest committed step",
        "storage/commits.py",
        'last = max(records, key=lambda r: int(r["version"]))',
        'last = min(records, key=lambda r: int(r["version"]))',
        G_COMMIT,
    ),
    Mutant(
        "latest version is the oldest",
        "storage/checkpoints.py",
        "return vs[-1] if vs else None",
        "return vs[0] if vs else None",
        G_COMMIT,
    ),
    Mutant(
        "learning summary: reward after is the first evaluation",
        "flows/evaluation.py",
        '"reward_after": curve[-1]["reward"],',
        '"reward_after": curve[0]["reward"],',
        ("tests/flows/test_learning.py",),
    ),
    Mutant(
        "rollouts ignore the rollout temperature",
        "tasks/rollout.py",
        "        temperature=cfg.temperature,\n",
        "        temperature=1.0,\n",
        G_ROLL,
    ),
    Mutant(
        "every session of a group draws with the same seed",
        "tasks/rollout.py",
        "seed = cfg.seed * 100_003 + spec.task_seed * 101 + i",
        "seed = cfg.seed * 100_003 + spec.task_seed * 101",
        G_ROLL,
    ),
    Mutant(
        "weight sync does not check the served digest",
        "infra/cells/engines.py",
        'if got is not None and dtype == want.get("dtype") and got != want["sha256"]:',
        "if False:",
        G_SYNC,
    ),
    Mutant(
        "step drop keeps a token one version past the lag bound",
        "tasks/train_step.py",
        "(sample.versions < version - max_lag)",
        "(sample.versions < version - max_lag - 1)",
        ("tests/tasks/test_drop_stale.py",),
    ),
    Mutant(
        "step drop also drops tokens at the lag bound",
        "tasks/train_step.py",
        "(sample.versions < version - max_lag)",
        "(sample.versions <= version - max_lag)",
        ("tests/tasks/test_drop_stale.py",),
    ),
    Mutant(
        "step drop keeps dropped tokens in the loss normaliser",
        "tasks/train_step.py",
        "n_flat_trainable=sample.n_flat_trainable - n_flat,",
        "n_flat_trainable=sample.n_flat_trainable,",
        ("tests/tasks/test_drop_stale.py",),
    ),
    Mutant(
        "a resumed run's weight loads in the coordinator's count (stale weights)",
        "infra/cells/executor.py",
        "return self.version0 + v",
        "return v",
        ("tests/infra/cells/test_resumed_versions.py",),
    ),
    Mutant(
        "a resumed run's loaded versions reported in the run's count",
        "infra/cells/executor.py",
        "return v - self.version0",
        "return v",
        ("tests/infra/cells/test_resumed_versions.py",),
    ),
]
