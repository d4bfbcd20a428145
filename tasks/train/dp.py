"""Data parallel with dynamic membership: the group is re-formed between steps, not the run.

A *generation* is one membership: ``world`` members with ranks ``0..world-1`` that meet
through a ``torch.distributed`` store under the prefix ``g{generation}``. When cells join or
leave training, the coordinator names a new generation; each member destroys its old process
group and forms the new one (gloo on CPU, NCCL on GPUs). Within a step:

1. :func:`sync_state` — members that do not hold the step's start version get the model and
   optimizer state broadcast from the lowest rank that does (a joining member receives it);
   if none holds it, every member loads the same checkpoint (the caller's ``load``).
2. :func:`shard` — every member computes the same token-balanced split of the batch.
3. ``Trainer.step(shard, normalizer=N, reduce_grads=group.reduce_grads)`` — each member's
   loss is normalised by the *whole* batch's trainable-token count ``N``, so summing the
   members' gradients gives exactly the one-member gradient (token-weighted combine); every
   member then clips and applies the same update.
4. :meth:`DPGroup.reduce_metrics` — sums what sums (loss, tokens) over members.

Centrally coordinated: the caller (the scheduler's executor) decides the members, ranks and
generation; nothing here elects anything. FSDP-ready in the sense that the process group is
the default one, formed with the documented ``init_process_group`` API.

May import torch.distributed; never prefect or dask.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SUM_METRICS = (
    "train/loss",
    "train/tokens",
    "train/trainable_tokens",
    "train/flat_tokens",
    "train/flat_trainable_tokens",
    "train/micro_batches",
    "train/n_samples",
)


class DPError(RuntimeError):
    """The group could not be formed or a collective failed; the step must be retried."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a generation's members meet: a TCPStore at ``host:port`` (hosted by the
    coordinator for the whole run), the generation number and this member's place."""

    host: str
    port: int
    generation: int
    rank: int
    world: int


@dataclass(frozen=True)
class StepPlan:
    """One data-parallel optimizer step, as the coordinator planned it (plain data).

    ``members``: cell ids in rank order; ``segments``: the samples segments of the groups
    it trains (``groups``: their rollout numbers); ``version``: the weights it starts from.
    ``workers``: where each member runs (the cells' worker addresses, in rank order); a
    retried step keeps everything but the generation, the members' places and the port.
    """

    step: int
    version: int
    generation: int
    host: str
    port: int
    members: tuple[str, ...]
    groups: tuple[int, ...]
    segments: tuple[str, ...]
    shuffle_seed: int = 0
    workers: tuple[str, ...] = ()
    pace_s: float = 0.0  # paced device time of the step (0: as computed), from a member's start

    def rendezvous(self, rank: int) -> Rendezvous:
        return Rendezvous(self.host, self.port, self.generation, rank, len(self.members))


def host_store(host: str = "127.0.0.1", port: int = 0, timeout_s: float = 600.0):
    """A TCPStore server for the generations of a run; returns ``(store, port)``.

    Keep the returned store alive as long as members may meet (it is the server). Dropping
    it makes every member still waiting to meet fail at once (a step being retried after a
    member was lost replaces it, so survivors do not wait out the timeout).
    """
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=True,
    )
    return store, store.port


GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` on this machine (None if none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def use_interface_of(address: str | None) -> str | None:
    """Make gloo's peers meet this member at ``address``, where the other hosts reach it.

    Gloo picks the address it tells its peers from the host name, which on a cluster node
    (or a network namespace) often resolves to loopback or to another network; members on
    other hosts then never connect. ``GLOO_SOCKET_IFNAME`` (read when a group is formed)
    names the interface instead: the one holding ``address``. A value the user set wins;
    loopback (one host) changes nothing. Returns the interface in force."""
    if address is None or address in ("127.0.0.1", "localhost", "::1"):
        return os.environ.get(GLOO_IFNAME)
    if os.environ.get(GLOO_IFNAME) and os.environ.get("_GYRE_GLOO_FOR") != address:
        return os.environ[GLOO_IFNAME]  # the user's own setting
    ifname = interface_of(address)
    if ifname is not None:
        os.environ[GLOO_IFNAME] = ifname
        os.environ["_GYRE_GLOO_FOR"] = address
    return ifname


def _distributed_c10d():
    import torch.distributed.distributed_c10d as c10d

    return c10d


def pick_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


class DPGroup:
    """This process's membership in one generation (the default process group)."""

    def __init__(
        self,
        rv: Rendezvous,
        *,
        backend: str = "auto",
        timeout_s: float = 600.0,
        local_host: str | None = None,
    ):
        """``local_host``: the address other members reach this one at (its cell's worker
        address; see `use_interface_of`)."""
        if not 0 <= rv.rank < rv.world:
            raise DPError(f"rank {rv.rank} outside a world of {rv.world}")
        self.rv = rv
        self.backend = pick_backend(backend)
        if self.backend == "gloo":
            use_interface_of(local_host)
        self.timeout = timedelta(seconds=timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()
        # The default group's keys in the store are prefixed by its name, which is how many
        # groups this process has made since the last destroy; a formation that failed (a
        # member lost while meeting) is counted but never destroyed. Such a member named
        # its next generation "1" while a fresh joiner (a restarted worker) named it "0":
        # the two waited for each other's keys until the timeout. Generations already have
        # their own prefix, so every member names its group as a fresh process does.
        _distributed_c10d()._world.group_count = 0
        t0 = time.monotonic()
        client = dist.TCPStore(
            rv.host,
            rv.port,
            is_master=False,
            timeout=self.timeout,
            use_libuv=True,
        )
        store = dist.PrefixStore(f"g{rv.generation}", client)
        try:
            dist.init_process_group(
                self.backend,
                store=store,
                rank=rv.rank,
                world_size=rv.world,
                timeout=self.timeout,
            )
        except Exception as exc:  # DistStoreError, RuntimeError: timed out waiting for peers
            raise DPError(
                f"generation {rv.generation}: rank {rv.rank} of {rv.world} could not form the "
                f"group at {rv.host}:{rv.port} within {timeout_s:.0f}s: {exc}"
            ) from exc
        self._client = client  # the group's store must outlive it
        self.formed_s = time.monotonic() - t0
        self.device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        log.info(
            "DP generation %d: rank %d of %d formed in %.2fs (%s)",
            rv.generation,
            rv.rank,
            rv.world,
            self.formed_s,
            self.backend,
        )

    @property
    def rank(self) -> int:
        return self.rv.rank

    @property
    def world(self) -> int:
        return self.rv.world

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives ---------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        x = t.to(self.device)
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x.to(t.device)

    def all_gather_ints(self, value: int) -> list[int]:
        out = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([value], dtype=torch.int64, device=self.device))
        return [int(x.item()) for x in out]

    def reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum gradients over members, in place: the Trainer's ``reduce_grads`` seam.

        A parameter that has a gradient on no member keeps ``None`` (the optimizer then
        skips it, as it would on one member); one that has a gradient on some member gets
        zeros elsewhere before the sum. One flat buffer per collective.
        """
        params = list(model.parameters())
        has = torch.tensor([0.0 if p.grad is None else 1.0 for p in params])
        has = self._all_reduce(has)
        live = [p for p, h in zip(params, has.tolist(), strict=True) if h > 0]
        if not live:
            return
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in live])
        flat = self._all_reduce(flat)
        i = 0
        for p in live:
            n = p.numel()
            p.grad.copy_(flat[i : i + n].view_as(p.grad))
            i += n

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Sum the summable metrics over members; clip fraction weighted by trainable tokens."""
        keys = [k for k in SUM_METRICS if k in metrics]
        clip = metrics.get("train/clip_fraction", 0.0) * metrics.get("train/trainable_tokens", 0)
        vec = torch.tensor([float(metrics[k]) for k in keys] + [clip], dtype=torch.float64)
        vec = self._all_reduce(vec)
        out = dict(metrics)
        for k, v in zip(keys, vec.tolist(), strict=False):
            out[k] = v
        n_train = out.get("train/trainable_tokens", 0.0)
        out["train/clip_fraction"] = float(vec[-1]) / n_train if n_train else 0.0
        return out

    def broadcast_state(self, trainer, src: int) -> None:
        """Model weights, optimizer state and counters from rank ``src`` to every member.

        A receiver's optimizer state is rebuilt to the sender's layout first (a fresh
        optimizer has none), so AdamW's moments and step counts arrive exactly.
        """
        head = torch.tensor(
            [trainer.version, trainer.n_steps, _has_opt_state(trainer)], dtype=torch.int64
        )
        head = head.to(self.device)
        dist.broadcast(head, src=src)
        version, n_steps, has_state = (int(x) for x in head.tolist())
        tensors = [p.data for p in trainer.model.parameters()]
        if has_state:
            if self.rank != src:
                _init_opt_state(trainer)
            tensors += _opt_tensors(trainer)
        with torch.no_grad():
            for t in tensors:
                x = t.to(self.device)
                dist.broadcast(x, src=src)
                if self.rank != src:
                    t.copy_(x.to(t.device))
        trainer.version, trainer.n_steps = version, n_steps


def _has_opt_state(trainer) -> int:
    return int(any(trainer.optimizer.state.get(p) for p in trainer.model.parameters()))


def _init_opt_state(trainer) -> None:
    """Give every parameter AdamW's state tensors (zeros), so a broadcast can fill them."""
    opt = trainer.optimizer
    for p in trainer.model.parameters():
        st = opt.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _opt_tensors(trainer) -> list[torch.Tensor]:
    out = []
    for p in trainer.model.parameters():
        st = trainer.optimizer.state[p]
        for k in sorted(st):
            v = st[k]
            if torch.is_tensor(v):
                out.append(v)
    return out


def sync_state(group: DPGroup, trainer, version: int, load: Callable[[], object]):
    """Bring every member to ``version`` before a step; returns ``(trainer, how)``.

    ``trainer``: this member's replica or None; ``load()``: a replica restored from the
    checkpoint of ``version`` (the store). Members holding ``version`` keep theirs; the
    others receive model and optimizer state by broadcast from the lowest rank that holds
    it (a member without any replica first loads one to receive into). If no member holds
    it, each loads the checkpoint (identical bytes everywhere). ``how`` is ``kept``,
    ``broadcast`` or ``checkpoint``.
    """
    mine = trainer is not None and trainer.version == version
    holders = group.all_gather_ints(1 if mine else 0)
    if not any(holders):
        return load(), "checkpoint"
    if all(holders):
        return trainer, "kept"
    if trainer is None:
        trainer = load()
    group.broadcast_state(trainer, src=holders.index(1))
    return trainer, "broadcast"


def shard(sizes: Sequence[int], world: int) -> list[list[int]]:
    """Split item indices over ``world`` members, balanced by ``sizes`` (tokens).

    Longest-first onto the least-loaded member (ties: lower rank), each member's items then
    in their original order. Deterministic, so every member computes the same split.
    """
    loads = [0] * world
    parts: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += sizes[i]
    return [sorted(p) for p in parts]


def pace(started: float, seconds: float) -> float:
    """Sleep until ``seconds`` have passed since ``started`` (monotonic); returns the sleep."""
    left = started + seconds - time.monotonic()
    if left > 0 and math.isfinite(left):
        time.sleep(left)
        return left
    return 0.0


def shard_with_context_parallel(
    sizes: Sequence[int], world: int, budget: int
) -> tuple[list[int], list[list[int]]]:
    """Items longer than one member's ``budget`` (tokens) go context parallel, the rest shard.

    Returns (the long items, in order, each trained by all ``world`` members together as
    slices of one sequence: tasks/train/context_parallel.py; the others' indices per member,
    as ``shard``). Deterministic, so every member computes the same plan."""
    long = [i for i, s in enumerate(sizes) if s > budget]
    rest = [i for i, s in enumerate(sizes) if s <= budget]
    parts = shard([sizes[i] for i in rest], world)
    return long, [[rest[j] for j in p] for p in parts]
