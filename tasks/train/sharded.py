"""Sharded training (``train.sharding=fsdp``): parameters, gradients and AdamW state split
over the step's members with torch's FSDP2, saved and re-split with torch.distributed.checkpoint.

What the installed torch (2.13.0+cpu) does on CPU with gloo, checked by running it:

- ``fully_shard`` on a 1-D ``DeviceMesh("cpu")``: works; parameters become ``DTensor``
  shards (``Shard(0)``: a (7, 5) weight is (4, 5) on rank 0 and (3, 5) on rank 1).
- backward: gloo has ``reduce_scatter`` / ``reduce_scatter_single`` in 2.13, and FSDP2's
  own reduce-scatter runs on it; no fallback needed. FSDP2 *averages* over members by
  default; gyre's normaliser needs the sum. ``set_gradient_divide_factor(1.0)`` alone
  reduces with ``ReduceOp.PREMUL_SUM``, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM
  with Gloo"); with ``set_force_sum_reduction_for_comms(True)`` too it is a plain SUM (and
  a division by 1, skipped): exact.
- ``clip_grad_norm_`` over ``DTensor`` gradients returns a ``DTensor``: the global norm over
  every shard (equal on all members), so clipping matches one replica.
- AdamW over ``DTensor`` parameters: works (each member updates its own shard).
- DCP ``save`` / ``load`` of ``get_state_dict(model, optim)`` and ``set_state_dict``:
  work, and reshard on load into a group of another size (2 -> 3 -> 1, bit for bit,
  tested; and back to 2 with the ranks swapped: the mesh names below). ``dcp.load``
  writes into the model's and optimizer's own shards in place (``set_state_dict`` after
  it changes nothing here; kept, as the documented path).
- DCP through fsspec: ``FsspecWriter`` / ``FsspecReader`` exist only in the private module
  ``torch.distributed.checkpoint._fsspec_filesystem`` (not exported from
  ``torch.distributed.checkpoint``); they work with ``file://`` (and any fsspec protocol).
  Workaround, named as such: import them from there; plain paths use the public
  ``FileSystemWriter`` / ``FileSystemReader``.
- ``DeviceMesh`` equality and hash leave out the process's rank, and DTensor's sharding
  caches key on them. A cell that meets a later group of the same size at another rank (a
  rank 1 of (a, b) that is rank 0 of (b, a)) got the earlier mesh back from those caches,
  with the earlier rank's coordinate: ``state_dict()`` then named rank 0's offsets on rank 1,
  and the load wrote each shard into the other's place (the step's loss 0.156 for the
  textbook's 0.679, measured; a save dropped half of every weight as a duplicate). Named
  workaround: every mesh this process makes gets its own dimension name (``dp0``, ``dp1``,
  ...; a name is local, nothing collective reads it), so no cache entry is shared between
  groups (tests/tasks/test_sharded_regroup.py swaps two members' ranks).

One honest limit, by design here: the loss code (tasks/train/packed_loss.py) calls the
decoder and ``lm_head`` directly, not ``model.forward``, and members train different numbers
of micro-batches (a member may have none), so per-layer FSDP units, whose forward and
backward are collectives, would issue different collective sequences on different members
and hang. So the whole model is one FSDP unit and a step is gradient accumulation without
sync: one all-gather (``unshard``) at the start, the member's own micro-batches with no
collective at all, then one *sync pass* (a 1-token forward through ``model.forward`` whose
backward adds zeros) on every member, in which FSDP2 reduce-scatters the accumulated
gradients and reshards. At rest (between steps) a member holds 1/k of the weights and
AdamW state (measured: bench/sharded.py); during a step it also holds the gathered full
weights and gradients, a peak of (2 + 3/k)/4 of a replica's (weights, gradients and two
moments: 4 units; 0.875 at k = 2, 0.69 at k = 4). Per-layer units (a peak of ~1/k) need
every member to run the same micro-batch schedule (padding with zero-weight micro-batches):
not done. Nor are: a new member building its trainer on the meta device (it loads the full
base checkpoint, then shards it), and sharding the frozen KL reference (``kl_coef > 0``
keeps a full reference on every member).

Membership changes: an FSDP model is bound to its group's mesh, so every member of a new
group (survivors too) builds a fresh trainer from the base checkpoint, shards it over the new
mesh and loads its own shards of the committed step's DCP state (``load_sharded``). The engine
still gets a consolidated safetensors checkpoint (``save_consolidated``: weights gathered on
rank 0, written with ``save_pretrained`` and the weights digest).

May import torch.distributed; never prefect or dask.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from storage.checkpoints import write_digest
from tasks.train import dp
from tasks.train.trainer import STATE_FILE, TOKENIZER_FILES, Trainer
from tasks.trajectory.sampler import Sample

log = logging.getLogger(__name__)

ADAMW_SETTINGS = ("lr", "betas", "eps", "weight_decay")
# one dimension name per mesh this process makes (DeviceMesh equality ignores the rank: above)
_MESHES = itertools.count()


class ShardedError(RuntimeError):
    """Sharded training was asked for something it cannot do; the message says what to do."""


def is_sharded(trainer: Trainer) -> bool:
    return isinstance(trainer.model, FSDPModule)


def shard_trainer(trainer: Trainer) -> Trainer:
    """Shard ``trainer``'s model over the members of the default process group (one FSDP
    unit on a 1-D device mesh) and rebuild its AdamW over the shards, same settings.

    The trainer must be fresh (no optimizer state yet): state enters a sharded trainer
    through ``load_sharded``. Returns the same trainer, changed in place."""
    if not dist.is_initialized():
        raise ShardedError("no process group: form the step's group first (dp.DPGroup)")
    if is_sharded(trainer):
        raise ShardedError("trainer is already sharded; build a fresh one for a new group")
    opt = trainer.optimizer
    if any(opt.state.values()):
        raise ShardedError(
            "shard a fresh trainer (no optimizer state), then load_sharded the committed "
            "state into it"
        )
    settings = {k: opt.param_groups[0][k] for k in ADAMW_SETTINGS}
    mesh = init_device_mesh(
        trainer.device.type, (dist.get_world_size(),), mesh_dim_names=(f"dp{next(_MESHES)}",)
    )
    fully_shard(trainer.model, mesh=mesh)
    # FSDP2 averages over members; the normaliser wants the sum. A divide factor alone is
    # reduced with PREMUL_SUM, which gloo refuses: force SUM (then a division by 1: none).
    trainer.model.set_gradient_divide_factor(1.0)
    trainer.model.set_force_sum_reduction_for_comms(True)
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), **settings)
    return trainer


def _sync_pass(model: torch.nn.Module, device: torch.device) -> None:
    """A 1-token forward through ``model.forward`` (FSDP2's hooks) and a backward of zeros:
    FSDP2's post-backward then reduce-scatters the gradients accumulated since ``unshard``
    (summed over members) into each member's shards and reshards the parameters."""
    out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    torch.autograd.backward(out.logits, torch.zeros_like(out.logits))


def sharded_step(
    trainer: Trainer,
    samples: Sequence[Sample],
    *,
    rank: int,
    world: int,
    current_version: int | None = None,
    before_reduce: Callable[[], object] | None = None,
) -> dict[str, float]:
    """One optimizer step of a sharded trainer on the whole batch ``samples`` (the same list,
    in the same order, on every member; stale tokens already dropped by the caller).

    Every member takes its token-balanced part (``dp.shard``), normalises by the whole
    batch's flat trainable-token count, and accumulates its gradients on the gathered
    model; the sync pass sums them over members into shards; ``Trainer.step`` then clips by
    the global norm over shards and applies AdamW to each shard. Returns this member's
    ``train/*`` metrics (sum them over members with ``dp.DPGroup.reduce_metrics``).
    ``before_reduce``: called once this member's own gradients are accumulated, before the
    sync pass (a paced member sleeps out its device time there, as ``reduce_grads`` does in
    the replicated step)."""
    if not is_sharded(trainer):
        raise ShardedError("sharded_step needs a sharded trainer: shard_trainer(trainer) first")
    if world != dist.get_world_size() or not 0 <= rank < world:
        raise ShardedError(
            f"rank {rank} of {world}: the process group has {dist.get_world_size()} members; "
            "form the step's group (dp.DPGroup) before sharded_step"
        )
    parts = dp.shard([s.n_tokens for s in samples], world)
    mine = [samples[i] for i in parts[rank]]
    n_flat = float(sum(s.n_flat_trainable for s in samples))
    model = trainer.model

    def reduce(m: torch.nn.Module) -> None:
        if before_reduce is not None:
            before_reduce()
        _sync_pass(m, trainer.device)
        if n_flat == 0:  # no loss term on any member: no update, as one replica skips it
            for p in m.parameters():
                p.grad = None

    model.unshard()  # one all-gather: the full weights on every member for this step
    return trainer.step(mine, current_version, normalizer=n_flat or 1.0, reduce_grads=reduce)


# -- checkpoints ---------------------------------------------------------------------------


def _writer(url: str):
    if "://" in url:
        # named workaround: torch 2.13 keeps the fsspec writer in a private module
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(url)
    return dcp.FileSystemWriter(url)


def _reader(url: str):
    if "://" in url:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url)
    return dcp.FileSystemReader(url)


def _state(trainer: Trainer) -> dict:
    msd, osd = get_state_dict(trainer.model, trainer.optimizer)
    return {
        "model": msd,
        "optim": osd,
        "trainer": {"version": trainer.version, "n_steps": trainer.n_steps},
    }


def save_sharded(trainer: Trainer, url: str) -> float:
    """Every member writes its own shards of weights and AdamW state (and rank 0 the
    counters) into ``url`` (a directory or an fsspec URL), with DCP; collective. Returns
    the seconds it took."""
    t0 = time.perf_counter()
    dcp.save(_state(trainer), storage_writer=_writer(url))
    return time.perf_counter() - t0


def load_sharded(trainer: Trainer, url: str) -> Trainer:
    """Load this member's shards of the DCP state at ``url`` into a fresh sharded trainer,
    whatever the number of members that saved it (DCP reshards); collective. Returns the
    trainer at the saved version, its optimizer's learning rate kept at ``trainer.lr``."""
    if not is_sharded(trainer):
        raise ShardedError("load_sharded needs a sharded trainer: shard_trainer(trainer) first")
    state = _state(trainer)  # shapes to load into (a fresh AdamW's state is made here)
    try:
        dcp.load(state, storage_reader=_reader(url))
    except (FileNotFoundError, dcp.CheckpointException) as exc:
        raise ShardedError(
            f"no complete sharded state at {url}: save_sharded the committed step there, or "
            f"start the group from a consolidated checkpoint ({exc})"
        ) from exc
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    for g in trainer.optimizer.param_groups:
        g["lr"] = trainer.lr
    trainer.version = int(state["trainer"]["version"])
    trainer.n_steps = int(state["trainer"]["n_steps"])
    return trainer


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on rank 0, on CPU; an empty dict elsewhere. Collective."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(trainer.model, options=opts)


def consolidated_model(trainer: Trainer, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain (unsharded) model of ``trainer``'s architecture holding ``weights``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(trainer.model.config, dtype=trainer.dtype)
    model.load_state_dict(weights, strict=True, assign=True)
    model.tie_weights()
    return model


def save_consolidated(trainer: Trainer, out_dir: str) -> str | None:
    """The consolidated checkpoint of the current version, as ``Trainer.save`` writes its
    weights: safetensors (``save_pretrained``), the weights digest an engine must serve
    (storage/checkpoints.py), the tokenizer files of ``model_dir`` and the counters; no
    optimizer state (that lives in the sharded state). Collective: the weights are gathered
    to rank 0, which writes and returns ``out_dir``; other members return None."""
    weights = full_weights(trainer)
    if dist.get_rank() != 0:
        return None
    model = consolidated_model(trainer, weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_digest(model, str(out))
    src = Path(trainer.model_dir)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and src.resolve() != out.resolve():
            shutil.copy2(src / name, out / name)
    (out / STATE_FILE).write_text(
        json.dumps({"version": trainer.version, "n_steps": trainer.n_steps})
    )
    return str(out)


def state_bytes(trainer: Trainer) -> int:
    """Bytes of this member's own training state at rest: its weight shards and AdamW
    moments (and gradients, when held), local parts only."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    n = 0
    for p in trainer.model.parameters():
        n += local(p)
        if p.grad is not None:
            n += local(p.grad)
    for st in trainer.optimizer.state.values():
        n += sum(local(v) for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return n
