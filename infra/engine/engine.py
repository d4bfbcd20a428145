"""The embedded engine: a transformers causal LM behind a continuous-batching scheduler.

What it does (DESIGN.md §5, issue 3):

- **Radix prefix KV cache** shared by all requests (`infra.engine.radix_cache`), LRU under a token
  budget; ``cached_tokens`` reports the prompt tokens whose KV came from it.
- **Continuous batching**: one scheduler thread. Running requests decode together, one token
  per step, in a left-padded batch KV buffer (`BatchKV`); new requests are prefilled (chunked)
  between decode steps, several waiting prompts in one forward when they fit a chunk
  together, and then join the batch. On the CPU the linear layers run from oneDNN-packed
  weights (`infra.engine.packed_linear`).
- **Logprobs**: for each output token, its logprob under the distribution it was drawn from:
  logits / temperature, cut to top-k and top-p, renormalised (`infra.engine.sampling`; the raw
  ``log_softmax`` when greedy). A trainer scoring the tokens under the same processing gets
  importance ratio 1 at zero staleness. Matches a full forward recompute (fp32) to ~1e-6.
- **Sampling**: greedy at temperature 0; otherwise temperature, top-k, top-p, then a draw from
  the request's own `torch.Generator` (seeded with ``sampling_seed``), so seeded output does not
  depend on what else is in the batch.
- **Memory**: ``kv_cache_tokens`` bounds all KV the engine holds, in tokens: the radix cache
  plus the running requests' own copies (batch rows and chunked prefills; the batch buffer's
  left padding and growth headroom are layout overhead, not counted). Admission is
  conservative: a request is prefilled only when its worst case (input + the most output it
  may still produce) fits next to the running requests' worst cases, after evicting LRU
  unpinned radix entries; otherwise it waits in FIFO order until room frees. So decode never
  runs out and nothing is retracted. The radix path a running request read is pinned until it
  leaves (`RadixCache.lock`). ``load()`` reports ``kv_tokens_used`` / ``kv_tokens_budget``.
- **Control**: abort by rid prefix, pause (abort | retract | in_place) / continue, hot weight
  reload at a step boundary, cache flush, KV export/import of a token prefix
  (`infra.engine.kv_transfer`).

All model and cache work happens on the scheduler thread; public methods are thread-safe and
either enqueue a request or run a command on that thread between two steps.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from infra.engine.batch_kv import BatchKV, BatchLayer, make_cache, prefill_mask
from infra.engine.errors import EngineInputError
from infra.engine.packed_linear import pack_linears
from infra.engine.radix_cache import RadixCache
from infra.engine.sampling import SamplingParams, sample_batch
from storage.checkpoints import weights_digest

log = logging.getLogger(__name__)

PREFILL_CHUNK = 1024  # tokens per prefill forward; decode steps run between chunks


@dataclass(eq=False)
class Request:
    """One generation request and its live state (owned by the scheduler thread)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = True
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: dict | None = None
    weight_version: int | None = None  # version that generated the first output token
    created: float = field(default_factory=time.time)
    first_token_at: float | None = None
    finished_at: float | None = None
    # scheduler-private
    aborted: str | None = None  # abort message, set by any thread
    generator: torch.Generator | None = None
    prefill_kv: Any = None  # DynamicCache during chunked prefill
    prefill_pos: int = 0  # tokens of `kv_ids` already in `prefill_kv`
    kv_epoch: int = -1  # weight epoch of the oldest KV this request holds
    radix_lock: Any = None  # pinned radix path (a `RadixCache.lock` handle) while admitted
    max_out: int = 0  # most output tokens it may produce (max_new_tokens within the context)
    done: threading.Event = field(default_factory=threading.Event)
    listeners: list = field(default_factory=list)  # callables(req), called after each update

    @property
    def kv_ids(self) -> list[int]:
        """Tokens whose KV the request needs before its next decode step."""
        if not self.output_ids:
            return self.input_ids
        return self.input_ids + self.output_ids[:-1]

    def notify(self) -> None:
        for fn in list(self.listeners):
            try:
                fn(self)
            except Exception:  # a listener must never kill the scheduler
                log.exception("request listener failed for %s", self.rid)


MMAP_THRESHOLD = 1 << 16  # bytes: larger allocations get their own mapping (glibc)


def return_large_frees_to_os() -> bool:
    """Make glibc map every allocation above ``MMAP_THRESHOLD`` on its own, so that a freed
    KV copy, prefill mask or logits buffer goes back to the OS at once (idempotent).

    glibc's default threshold grows with each freed mapping up to 32 MB, after which the
    per-call tensors of a long session (a prefix copy, a (B, Q, P + Q) mask) come from the
    heap and fragment it: the resident size of one engine serving two 60K-token sessions
    was 1.85 GB (peak 2.1) for 62 MB of live tensors, 0.63 GB (peak 0.98) with this set.
    Returns False where there is no glibc (nothing to do)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        ok = libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD) == 1
        return ok and libc.mallopt(m_trim_threshold, 4 * MMAP_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False


class Engine:
    """Embedded CPU engine over any local HF causal-LM checkpoint directory."""

    def __init__(
        self,
        model_dir: str,
        *,
        weight_version: int = 0,
        max_batch_size: int = 16,
        kv_cache_tokens: int = 262144,
        device: str = "cpu",
        dtype=torch.float32,
        cell_id: str = "local",
        torch_threads: int | None = 1,
        audit_path: str | None = None,
        pack_weights: bool = True,
    ):
        """Load `model_dir` and start the scheduler thread.

        `audit_path`: append every admitted request (``{"rid", "input_ids"}``) to this
        JSONL file, so that what the engine was asked can be audited against what the
        gateway recorded in TITO (token exactness, end to end).

        `torch_threads`: intra-op threads of the scheduler thread (`torch.set_num_threads`
        there; with torch's OpenMP backend other threads keep their own). The default 1 is
        deliberate: a tiny model's matmuls gain nothing from more, and on a
        loaded 2-core machine OpenMP spinning made a 16-row decode step ~13x slower (63 ms vs
        4.7 ms). None leaves torch's setting alone.

        `pack_weights`: on the CPU in fp32, serve the linear layers from oneDNN-packed copies
        of their weights (`infra.engine.packed_linear`: the same fp32 arithmetic, 2-3x faster
        matmuls at decode's few rows; one more copy of the linear weights in memory).
        """
        self.model_dir = str(model_dir)
        self._audit = _AuditLog(audit_path) if audit_path else None
        self.device = torch.device(device)
        self.dtype = dtype
        self.cell_id = cell_id
        self._torch_threads = torch_threads
        self._pack_weights = bool(pack_weights)
        self.max_batch_size = max_batch_size
        return_large_frees_to_os()
        self.model, self.tokenizer = self._load(self.model_dir)
        cfg = self.model.config.get_text_config(decoder=True)
        self.model_type = str(getattr(cfg, "model_type", "") or "")  # qwen3, llama, qwen2, ...
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.max_context = int(getattr(cfg, "max_position_embeddings", 32768))
        self.eos_token_ids = self._eos_ids()
        self._cache_kw = (
            "cache"
            if "cache" in inspect.signature(self.model.forward).parameters
            else "past_key_values"
        )
        self.kv_budget = int(kv_cache_tokens)
        self.radix = RadixCache(self.kv_budget)
        self._kv_used = 0  # last published by the scheduler (`_note_kv`)
        self._kv_peak = 0
        self._weight_version = int(weight_version)
        self._digest: tuple[object, str] | None = None  # (model, its weights digest)
        self._epoch = 0  # bumps on every weight change: KV of older epochs is stale
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._commands: queue.Queue = queue.Queue()
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._batch: BatchKV | None = None
        self._paused: str | None = None
        self._closed = False
        self._rid_counter = itertools.count()
        self.stats = {
            "engine/decode_steps": 0,
            "engine/prefill_tokens": 0,
            "engine/prefill_forwards": 0,  # a batched prefill of several prompts counts one
            "engine/cached_tokens": 0,
        }
        self._thread = threading.Thread(target=self._loop, name=f"engine-{cell_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ loading
    def _load(self, path: str, *, with_tokenizer: bool = True):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        model.to(self.device).eval()
        if self._pack_weights:  # before the model is served: its weights never change after
            pack_linears(model)
        if not with_tokenizer:
            return model, None
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception:  # a bare weights dir (e.g. a trainer checkpoint) is still servable
            tokenizer = None
        return model, tokenizer

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        eos = getattr(self.model.config, "eos_token_id", None)
        for e in eos if isinstance(eos, list) else [eos]:
            if e is not None and int(e) not in ids:
                ids.append(int(e))
        return ids

    # ------------------------------------------------------------------ public API
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def submit(
        self,
        input_ids: list[int],
        sampling_params: dict | SamplingParams | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        listener=None,
    ) -> Request:
        """Queue a request; returns its live `Request` (wait on ``req.done``)."""
        if self._closed:
            raise RuntimeError("engine is closed")
        params = (
            sampling_params
            if isinstance(sampling_params, SamplingParams)
            else SamplingParams.from_dict(sampling_params or {})
        )
        ids = self._validate_ids(input_ids)
        if len(ids) >= self.max_context:
            raise EngineInputError(
                f"input has {len(ids)} tokens; the model's context is {self.max_context} "
                "(input must leave room for at least one output token)"
            )
        req = Request(rid=rid or uuid.uuid4().hex, input_ids=ids, params=params)
        req.max_out = min(params.max_new_tokens, self.max_context - len(ids))
        if self._footprint(req) > self.kv_budget:
            raise EngineInputError(
                f"input ({len(ids)} tokens) + max_new_tokens ({req.max_out}) needs "
                f"{self._footprint(req)} KV tokens but the engine's KV budget is "
                f"kv_cache_tokens={self.kv_budget}: lower max_new_tokens, shorten the input, "
                "or raise --kv-cache-tokens"
            )
        req.return_logprob = bool(return_logprob)
        seed = params.sampling_seed
        req.generator = torch.Generator().manual_seed(
            int(seed) if seed is not None else int.from_bytes(os.urandom(7), "little")
        )
        if listener is not None:
            req.listeners.append(listener)
        if self._audit is not None:
            self._audit.write(req.rid, ids)
        with self._wake:
            self._inbox.append(req)
            self._wake.notify()
        return req

    def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True) -> dict:
        """Blocking generate; returns the SGLang-shaped response dict."""
        req = self.submit(input_ids, sampling_params, rid=rid, return_logprob=return_logprob)
        req.done.wait()
        return self.response(req)

    def response(self, req: Request, *, upto: int | None = None, detokenizer=None) -> dict:
        """SGLang `/generate` response for `req` (its first `upto` output tokens if given).

        A streamer passes its `IncrementalDetokenizer` with `upto`: the text then costs the new
        tokens only, and may hold back the last few until a UTF-8 character completes. Without
        `upto` the text is one full decode, so a stream ends exactly as a plain call does.
        """
        n = len(req.output_ids) if upto is None else upto
        out = req.output_ids[:n]
        meta = {
            "id": req.rid,
            "finish_reason": req.finish_reason if upto is None else None,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": n,
            "cached_tokens": req.cached_tokens,
            "weight_version": str(
                req.weight_version if req.weight_version is not None else self._weight_version
            ),
            "output_token_weight_versions": req.token_versions[:n],
            "cell_id": self.cell_id,
            "e2e_latency": (req.finished_at or time.time()) - req.created,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(req.output_logprobs[:n], out, strict=False)
            ]
        if self.tokenizer is None:
            text = ""
        elif upto is not None and detokenizer is not None:
            text = detokenizer.update(out)
        else:
            text = self.tokenizer.decode(out)
        matched = (req.finish_reason or {}).get("matched") if upto is None else None
        if isinstance(matched, str) and not req.params.no_stop_trim and matched in text:
            text = text[: text.index(matched)]  # SGLang trims the stop string from `text`
        return {"text": text, "output_ids": out, "meta_info": meta}

    def abort(self, rid: str = "", *, abort_all: bool = False) -> int:
        """Abort requests whose rid starts with `rid` (SGLang semantics); returns how many."""
        with self._lock:
            reqs = self._inbox + self._waiting + self._running
        n = 0
        for r in reqs:
            if r.finish_reason is None and (abort_all or (rid and r.rid.startswith(rid))):
                r.aborted = "aborted by request"
                n += 1
        if n:  # wake the scheduler to reap them, even while paused (no waiting on it here)
            self._commands.put((lambda: None, Future()))
            self._kick()
        return n

    def cancel(self, req: Request, message: str = "cancelled") -> None:
        """Abort exactly `req` (not every rid it prefixes, unlike `abort`)."""
        if req.finish_reason is None:
            req.aborted = message
            self._commands.put((lambda: None, Future()))
            self._kick()

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating at the next step boundary.

        abort: in-flight requests finish now with ``finish_reason.type == "abort"`` and their
        partial output. retract: running requests go back to the queue (their KV into the radix
        cache) and resume by re-prefill on continue. in_place: everything stays as it is.
        New requests queue while paused.
        """
        if mode not in ("abort", "retract", "in_place"):
            raise EngineInputError(f"pause mode {mode!r}: use abort, retract or in_place")
        self._run_command(lambda: self._do_pause(mode))

    def continue_generation(self) -> None:
        self._run_command(self._do_continue)

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict:
        """Load a checkpoint and swap it in between two decode steps.

        In-flight requests continue under the new weights (their earlier KV stays as computed).
        Returns ``{"success": bool, "message": str}``.
        """
        try:
            model, _ = self._load(model_path, with_tokenizer=False)
        except Exception as e:  # report, never crash the server
            return {"success": False, "message": f"failed to load {model_path}: {e}"}
        cfg = model.config.get_text_config(decoder=True)
        shape = (
            str(getattr(cfg, "model_type", "") or ""),
            cfg.num_hidden_layers,
            getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            cfg.vocab_size,
        )
        # the family too: two families of one shape (a Qwen3 and a Llama) compute different
        # things, so in-flight requests' KV (and the cache, without a flush) would be wrong
        mine = (self.model_type, self.num_layers, self.num_kv_heads, self.head_dim, self.vocab_size)
        if shape != mine:
            return {
                "success": False,
                "message": f"{model_path}: (model type, layers, kv heads, head dim, vocab) = "
                f"{shape} differ from the served model's {mine}; weights must fit the same "
                "architecture",
            }
        if weight_version is None:
            version = self._weight_version + 1
        else:
            try:
                version = int(weight_version)
            except (TypeError, ValueError):
                return {
                    "success": False,
                    "message": f"weight_version {weight_version!r} must be an integer",
                }

        def swap():
            if abort_all_requests:
                self._abort_all("aborted by weight update")
            self.model = model
            self.model_dir = str(model_path)
            self._weight_version = version
            self._epoch += 1
            if flush_cache:
                self.radix.flush()
                self._note_kv()

        self._run_command(swap)
        return {"success": True, "message": f"loaded {model_path} as weight version {version}"}

    def flush_cache(self) -> bool:
        def flush():
            self.radix.flush()
            self._note_kv()

        self._run_command(flush)
        return True

    def export_kv(self, input_ids: list[int]) -> bytes:
        """KV of the longest cached prefix of `input_ids`, serialized (see `infra.engine.kv_transfer`)."""
        from infra.engine import kv_transfer

        ids = self._validate_ids(input_ids)
        n, kv = self._run_command(lambda: self.radix.match(ids))
        return kv_transfer.dumps(ids[:n], kv, self._kv_meta())

    def import_kv(self, blob: bytes) -> int:
        """Insert an exported prefix into the radix cache; returns the tokens imported.

        Imports the longest part of the prefix that fits the KV budget now (all of it unless
        running requests hold most of the budget).
        """
        from infra.engine import kv_transfer

        ids, kv, meta = kv_transfer.loads(blob)
        kv_transfer.check_compatible(meta, self._kv_meta())
        if not ids:
            return 0
        self._validate_ids(ids)
        kv = kv.to(device=self.device, dtype=self.dtype)
        return self._run_command(lambda: self._cache_insert(ids, kv, partial=True))

    def name_version(self, version: int) -> None:
        """The policy version the loaded weights are (a checkpoint identified by its
        weights digest, flows/serve.py): what every answer reports until the next
        ``update_weights``. Call before serving."""
        self._weight_version = int(version)

    def weights_digest(self) -> str:
        """sha256 of the weights being served (storage/checkpoints.py ``weights_digest``),
        computed once per loaded model: what a weight sync checks against the checkpoint."""
        model, cached = self.model, self._digest
        if cached is None or cached[0] is not model:
            cached = (model, weights_digest(model))
            self._digest = cached
        return cached[1]

    def model_info(self) -> dict:
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir,
            "is_generation": True,
            "max_context_length": self.max_context,
            "vocab_size": self.vocab_size,
            "eos_token_ids": self.eos_token_ids,
            "weight_version": str(self._weight_version),
            "weights_digest": self.weights_digest(),
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_batch_size": self.max_batch_size,
            "kv_cache_tokens": self.kv_budget,
            "kv_tokens_budget": self.kv_budget,
            "kv_bytes_per_token": self.kv_bytes_per_token(),
            "cell_id": self.cell_id,
            "engine": "gyre-embedded",
        }

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one cached token holds: layers x (key, value) x kv heads x head dim x
        element size (the tiny model: 2 x 2 x 2 x 16 x 4 B = 512 B; 1M tokens = 512 MB)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def load(self) -> dict:
        """Queue depths and cache use, for routing and tests."""
        with self._lock:
            return {
                "running": len(self._running),
                "waiting": len(self._waiting) + len(self._inbox),
                "radix_tokens": self.radix.total_tokens,
                "kv_tokens_used": self._kv_used,
                "kv_tokens_peak": self._kv_peak,
                "kv_tokens_budget": self.kv_budget,
                "kv_bytes_per_token": self.kv_bytes_per_token(),
                "paused": self._paused,
                **self.stats,
            }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._audit is not None:
            self._audit.close()
        self._kick()
        self._thread.join(timeout=10)
        for r in self._inbox + self._waiting + self._running:
            if r.finish_reason is None:
                self._finish(r, {"type": "abort", "message": "engine closed"})
        while not self._commands.empty():  # commands that raced with close
            _, fut = self._commands.get()
            fut.set_exception(RuntimeError("engine is closed"))

    # ------------------------------------------------------------------ internals
    def _validate_ids(self, input_ids) -> list[int]:
        if not isinstance(input_ids, list | tuple) or not input_ids:
            raise EngineInputError("input_ids must be a non-empty list of token ids")
        ids = []
        for t in input_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise EngineInputError(
                    f"invalid token id {t!r}: ids must be ints in [0, {self.vocab_size})"
                )
            ids.append(int(t))
        return ids

    def _kv_meta(self) -> dict:
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "weight_version": self._weight_version,
            "model_path": self.model_dir,
        }

    # -- KV budget (scheduler thread)
    @staticmethod
    def _footprint(req: Request) -> int:
        """Most KV tokens `req` can ever hold: its input and every output it may produce."""
        return len(req.input_ids) + req.max_out

    def _admitted(self) -> list[Request]:
        """Requests holding KV of their own: the running batch and chunked prefills."""
        return self._running + [r for r in self._waiting if r.prefill_kv is not None]

    def _kv_held(self) -> int:
        """KV tokens held now: radix cache + batch rows + chunked prefills so far."""
        rows = sum(self._batch.lens) if self._batch is not None else 0
        prefills = sum(r.prefill_pos for r in self._waiting if r.prefill_kv is not None)
        return self.radix.total_tokens + rows + prefills

    def _reserved(self) -> int:
        """KV tokens the admitted requests may grow to (each one's worst case)."""
        return sum(self._footprint(r) for r in self._admitted())

    def _make_room(self, tokens: int) -> bool:
        """Evict LRU unpinned radix entries until `tokens` more fit next to every admitted
        request's worst case. False, evicting nothing, if even the pinned entries leave no
        room for them."""
        target = self.kv_budget - self._reserved() - tokens
        if self.radix.pinned_tokens > target:
            return False
        if self.radix.total_tokens > target:
            self.radix.evict(target)
        return True

    def _cache_insert(self, ids: list[int], kv: torch.Tensor, partial: bool = False) -> int:
        """Insert `ids` (KV ``(L, 2, H, n, D)``) into the radix cache within the budget.

        Evicts first, so the cache never overshoots. Without room the insert is skipped (it is
        only a cache), or with `partial` the longest prefix that fits goes in. Returns the
        tokens of `ids` now cached.
        """
        have = self.radix.prefix_len(ids)
        guard = self.radix.lock(ids[:have])  # eviction must not cut the path being extended
        try:
            n = len(ids)
            if not self._make_room(n - have):
                if not partial:
                    return have
                room = max(0, self.kv_budget - self._reserved() - self.radix.pinned_tokens)
                self._make_room(room)
                n = have + room
            if n > have:
                self.radix.insert(ids[:n], kv[:, :, :, :n])
            return max(n, have)
        finally:
            self.radix.unlock(guard)
            self._note_kv()

    def _release(self, req: Request) -> None:
        """`req` no longer holds KV: unpin its radix path."""
        self.radix.unlock(req.radix_lock)
        req.radix_lock = None

    def _note_kv(self) -> None:
        """Publish KV use for `load()` (read by other threads) and track its peak."""
        self._kv_used = self._kv_held()
        self._kv_peak = max(self._kv_peak, self._kv_used)

    def _kick(self) -> None:
        with self._wake:
            self._wake.notify()

    def _run_command(self, fn):
        """Run `fn` on the scheduler thread at the next step boundary; return its result."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._closed:
            raise RuntimeError("engine is closed")
        fut: Future = Future()
        self._commands.put((fn, fut))
        self._kick()
        return fut.result()

    def _forward(self, input_ids, position_ids, cache, attention_mask=None):
        kwargs = {self._cache_kw: cache, "use_cache": True}
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                logits_to_keep=1,
                **kwargs,
            )
        # (B, V) on the CPU: sampling uses each request's CPU generator, on any device
        return out.logits[:, -1, :].float().cpu()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self._torch_threads is not None:
            # OpenMP's thread count is per calling thread: this sets the scheduler's only
            torch.set_num_threads(self._torch_threads)
        while True:
            with self._wake:
                while (
                    not self._closed
                    and self._commands.empty()
                    and not self._inbox
                    and (self._paused or (not self._waiting and not self._running))
                ):
                    self._wake.wait(timeout=0.5)
                if self._closed:
                    return
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                self._step()
            except Exception as e:  # fail the requests in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(f"engine error: {e!r}")

    def _step(self) -> None:
        while not self._commands.empty():
            fn, fut = self._commands.get()
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)
        self._reap_aborted()
        if self._paused:
            return
        self._prefill_some()
        if self._running:
            self._decode_step()

    # -- abort / pause
    def _reap_aborted(self) -> None:
        for r in [r for r in self._waiting if r.aborted]:
            self._waiting.remove(r)
            r.prefill_kv, r.prefill_pos = None, 0
            self._release(r)
            self._finish(r, {"type": "abort", "message": r.aborted})
        self._note_kv()
        gone = [i for i, r in enumerate(self._running) if r.aborted]
        if gone:
            reqs = [self._running[i] for i in gone]
            self._remove_rows(gone, cache=True)  # their KV is valid: keep it for a resubmit
            for r in reqs:
                self._finish(r, {"type": "abort", "message": r.aborted})

    def _fail_all(self, message: str) -> None:
        """After an internal error: finish every request with an abort, drop the batch."""
        with self._lock:
            reqs = self._inbox + self._waiting + self._running
            self._inbox, self._waiting, self._running = [], [], []
        self._batch = None
        for r in reqs:
            r.prefill_kv, r.prefill_pos = None, 0
            self._release(r)
            if r.finish_reason is None:
                self._finish(r, {"type": "abort", "message": message})

    def _abort_all(self, message: str) -> None:
        for r in self._inbox + self._waiting + self._running:
            r.aborted = r.aborted or message
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        self._reap_aborted()

    def _do_pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort_all("aborted by pause_generation")
        elif mode == "retract":
            rows = list(range(len(self._running)))
            retracted = [self._running[i] for i in rows]
            self._remove_rows(rows, cache=True)
            for r in retracted:
                r.prefill_kv, r.prefill_pos = None, 0
            self._waiting[:0] = retracted
        self._paused = mode

    def _do_continue(self) -> None:
        self._paused = None

    # -- prefill
    def _prefill_some(self) -> None:
        """Prefill waiting requests, up to one chunk of tokens, while the batch has room.

        Whole prompts that fit the chunk together go through one forward (`_prefill_group`,
        `_prefill_batch`): on the CPU a forward of B prompts costs ~25% less per token than B
        forwards of one. A prompt longer than what is left of the chunk is prefilled alone, in
        chunks, with decode steps between them.
        """
        budget = PREFILL_CHUNK
        while self._waiting and budget > 0 and len(self._running) < self.max_batch_size:
            group = self._prefill_group(budget)
            if not group:
                break  # no KV room: the head (and everything behind it) waits for room to free
            if len(group) > 1:
                budget -= self._prefill_batch(group)
                continue
            req = group[0]
            budget -= self._prefill_chunk(req, budget)
            if req.prefill_kv is None and req.prefill_pos == 0:
                continue  # finished or admitted: loop picks the next one
            if req.prefill_pos < len(req.kv_ids):
                break  # partially prefilled; decode a step, then go on

    def _prefill_group(self, budget: int) -> list[Request]:
        """The waiting requests to prefill next, admitted; [] if the head cannot be.

        The head alone when it is a chunked prefill in progress or its prompt does not fit
        `budget`; else the head and the requests behind it whose uncached prompts fit `budget`
        together, padded to the longest (padding at most a fifth of the forward). A request
        that shares more of its prompt with one in the group than the radix cache holds waits
        for the group's KV to be cached, as it would one by one (an RL group's copies of one
        prompt are computed once; ``cached_tokens`` is the same).
        """
        group: list[Request] = []
        room = self.max_batch_size - len(self._running)
        tokens = 0  # uncached prompt tokens of the group
        for req in list(self._waiting):
            if len(group) == room:
                break
            if req.prefill_kv is not None:  # a chunked prefill in progress
                return group or [req]
            ids = req.kv_ids
            if group:
                cached = self.radix.prefix_len(ids[: self._reusable(req)])
                todo = len(ids) - cached
                width = max(todo, *(len(r.kv_ids) - r.prefill_pos for r in group))
                padded = (len(group) + 1) * width
                if todo == 0 or padded > budget or padded > 1.25 * (tokens + todo):
                    break
                reusable = self._reusable(req)
                if any(min(_common_prefix(ids, r.kv_ids), reusable) > cached for r in group):
                    break
            if not self._admit(req):
                break
            group.append(req)
            tokens += len(ids) - req.prefill_pos
            if len(group) == 1 and not 0 < len(ids) - req.prefill_pos <= budget:
                break  # nothing to compute, or a chunked prefill: alone
        return group

    def _prefill_batch(self, group: list[Request]) -> int:
        """Prefill the admitted `group` in one forward; returns its tokens, padding included.

        Row b: its cached KV right-aligned before column P, its new tokens right-aligned in
        the Q columns after it (`prefill_mask`), so the last column holds every row's last
        token and ``logits_to_keep=1`` gives each row's next-token logits.
        """
        past = [r.prefill_pos for r in group]
        new = [len(r.kv_ids) - n for r, n in zip(group, past, strict=True)]
        P, Q, B = max(past), max(new), len(group)
        buf = torch.zeros(
            (self.num_layers, 2, B, self.num_kv_heads, P + Q, self.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        tokens = torch.zeros((B, Q), dtype=torch.long)
        pos = torch.zeros((B, Q), dtype=torch.long)
        for b, (r, n, m) in enumerate(zip(group, past, new, strict=True)):
            for i, lay in enumerate(r.prefill_kv.layers if n else []):
                buf[i, 0, b, :, P - n : P] = lay.keys[0]
                buf[i, 1, b, :, P - n : P] = lay.values[0]
            tokens[b, Q - m :] = torch.tensor(r.kv_ids[n:])
            pos[b, Q - m :] = torch.arange(n, n + m)
        cache = make_cache([BatchLayer(buf[i, 0], buf[i, 1], P) for i in range(self.num_layers)])
        mask = prefill_mask(past, new, self.dtype).to(self.device)
        logits = self._forward(tokens.to(self.device), pos.to(self.device), cache, mask)
        self.stats["engine/prefill_tokens"] += sum(new)
        self.stats["engine/prefill_forwards"] += 1
        firsts = [b for b, r in enumerate(group) if not r.output_ids]
        drawn = self._choose(logits[firsts], [group[b] for b in firsts]) if firsts else []
        picks = dict(zip(firsts, drawn, strict=True))
        for b, (r, n, m) in enumerate(zip(group, past, new, strict=True)):
            kv = torch.cat([buf[:, :, b, :, P - n : P], buf[:, :, b, :, P + Q - m :]], dim=3)
            self._prefill_done(r, kv, picks.get(b))
        return B * Q

    @staticmethod
    def _reusable(req: Request) -> int:
        """How much of `req.kv_ids` may come from the radix cache: all but the last input
        token, whose logits give the first output token (all of it when resuming)."""
        return len(req.kv_ids) - 1 if not req.output_ids else len(req.kv_ids)

    def _admit(self, req: Request) -> bool:
        """Start `req`'s prefill if its worst case fits the KV budget (evicting LRU entries).

        Pins the cached prefix it will read, so making room never evicts it; it stays pinned
        while the request holds KV.
        """
        from transformers.cache_utils import DynamicCache

        ids = req.kv_ids
        limit = self._reusable(req)
        req.radix_lock = self.radix.lock(ids[:limit]) if limit > 0 else None
        if not self._make_room(self._footprint(req)):
            self._release(req)
            return False
        n, kv = self.radix.match(ids[:limit]) if limit > 0 else (0, None)
        if not req.output_ids:
            req.cached_tokens = n
            self.stats["engine/cached_tokens"] += n
        req.kv_epoch = self._epoch
        cache = DynamicCache()
        if n:
            for i in range(self.num_layers):
                cache.update(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0), i)
        req.prefill_kv, req.prefill_pos = cache, n
        self._note_kv()
        return True

    def _prefill_chunk(self, req: Request, budget: int) -> int:
        """Advance an admitted `req`'s prefill by up to `budget` tokens; batch it when complete."""
        ids = req.kv_ids
        todo = min(budget, len(ids) - req.prefill_pos)
        logits = None
        if todo > 0:
            start = req.prefill_pos
            chunk = torch.tensor([ids[start : start + todo]], device=self.device)
            pos = torch.arange(start, start + todo, device=self.device).unsqueeze(0)
            logits = self._forward(chunk, pos, req.prefill_kv)
            req.prefill_pos += todo
            self.stats["engine/prefill_tokens"] += todo
            self.stats["engine/prefill_forwards"] += 1
            self._note_kv()
        if req.prefill_pos < len(ids):
            return todo
        # Prefill complete: (L, 2, H, n, D) from the DynamicCache.
        kv = torch.stack(
            [torch.stack([lay.keys[0], lay.values[0]]) for lay in req.prefill_kv.layers]
        )
        pick = None if req.output_ids else self._choose(logits[:1], [req])[0]
        self._prefill_done(req, kv, pick)
        return todo

    def _prefill_done(self, req: Request, kv: torch.Tensor, pick: tuple | None) -> None:
        """`req`'s prefill is complete with KV ``(L, 2, H, n, D)``: cache it, append its first
        token (`pick`, None when resuming), then finish it or add it to the running batch."""
        if self._epoch == req.kv_epoch:  # still admitted here, so its worst case stays reserved
            self._cache_insert(req.kv_ids, kv)
        req.prefill_kv, req.prefill_pos = None, 0
        self._waiting.remove(req)
        if pick is not None:
            reason = self._append(req, *pick)
            if reason is not None:
                self._release(req)
                self._note_kv()
                self._finish(req, reason)
                return
        self._add_row(req, kv)
        self._note_kv()

    # -- decode
    def _add_row(self, req: Request, kv: torch.Tensor) -> None:
        if self._batch is None:
            self._batch = BatchKV(like=kv)
        self._batch.add(kv)
        self._running.append(req)

    def _remove_rows(self, idx: list[int], cache: bool = False) -> None:
        """Drop rows `idx` from the batch; with `cache`, insert their KV into the radix cache.

        `BatchKV.remove` moves the last row into the freed slot; `_running` mirrors that.
        """
        for b in sorted(set(idx), reverse=True):
            r = self._running[b]
            kv = self._batch.remove(b)
            self._running[b] = self._running[-1]
            self._running.pop()
            self._release(r)
            if cache and r.kv_epoch == self._epoch:
                self._cache_insert(r.kv_ids, kv)
        if not self._running:
            self._batch = None
        self._note_kv()

    def _decode_step(self) -> None:
        batch = self._batch
        batch.ensure_room(1)
        tokens = torch.tensor([[r.output_ids[-1]] for r in self._running], device=self.device)
        pos = torch.tensor([[n] for n in batch.lens], device=self.device)
        mask = batch.attention_mask(self.dtype).to(self.device)
        logits = self._forward(tokens, pos, batch.cache(), mask)
        batch.advance(1)
        self.stats["engine/decode_steps"] += 1
        self._note_kv()
        picks = self._choose(logits, self._running)
        reasons = [self._append(r, *pick) for r, pick in zip(self._running, picks, strict=True)]
        done = [(b, r, why) for b, (r, why) in enumerate(zip(self._running, reasons, strict=True))]
        done = [(b, r, why) for b, r, why in done if why is not None]
        if done:
            self._remove_rows([b for b, _, _ in done], cache=True)
            for _, r, reason in done:
                self._finish(r, reason)

    def _choose(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple[int, float]]:
        """(token, raw logprob) for each row of ``logits`` (B, V): one batched draw.

        The caller appends each choice (`_append`) and finishes the requests that are done
        (after taking their KV out of the batch), so a waiter woken by ``req.done`` already sees
        the engine without it.
        """
        return sample_batch(logits, [r.params for r in reqs], [r.generator for r in reqs])

    def _append(self, req: Request, token: int, logprob: float) -> dict | None:
        """Append a chosen token to `req`; returns the finish reason if it is done."""
        if req.weight_version is None:
            req.weight_version = self._weight_version
            req.first_token_at = time.time()
        # output_ids last: a reader on another thread that sees n ids sees n of the rest too
        req.output_logprobs.append(logprob)
        req.token_versions.append(self._weight_version)
        req.output_ids.append(token)
        p = req.params
        reason = None
        if len(req.output_ids) >= p.min_new_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            reason = {"type": "stop", "matched": token}
        elif p.stop and len(req.output_ids) >= p.min_new_tokens and self.tokenizer is not None:
            matched = self._stop_string(req.output_ids, p.stop)
            if matched is not None:
                reason = {"type": "stop", "matched": matched}
        if reason is None and (
            len(req.output_ids) >= p.max_new_tokens
            or len(req.input_ids) + len(req.output_ids) >= self.max_context
        ):
            reason = {"type": "length", "length": len(req.output_ids)}
        if reason is None:
            req.notify()
        return reason

    def _stop_string(self, output_ids: list[int], stops: tuple[str, ...]) -> str | None:
        """The stop string that the last token completed, if any (decodes a short tail)."""
        window = 4 * max(len(x) for x in stops) + 4  # a char may take up to 4 byte tokens
        tail = self.tokenizer.decode(output_ids[-window:])
        before = self.tokenizer.decode(output_ids[-window:-1]) if len(output_ids) > 1 else ""
        for s in stops:
            if tail.count(s) > before.count(s):  # completed by this token
                return s
        return None

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish_reason = reason
        req.finished_at = time.time()
        req.done.set()
        req.notify()


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of `a` and `b`."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


class _AuditLog:
    """Append-only JSONL of the requests an engine admitted (see ``Engine(audit_path=)``)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fh = open(path, "a")  # noqa: SIM115  (lives as long as the engine)
        self._lock = threading.Lock()

    def write(self, rid: str, input_ids) -> None:
        line = json.dumps({"rid": rid, "input_ids": [int(t) for t in input_ids]})
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()
