"""Paced device time: a cell's engine works at a fixed speed, whatever the CPU does.

Benchmarks of the scheduler need many cells; 2 CPU cores cannot give each one real
accelerator speed, and a tiny model's compute is too small and too noisy under contention to
stand for it. A paced engine takes at least ``decode_step_s`` per decode step (for any batch
up to its ``max_batch_size``: a GPU decodes a batch in about the time of one row) and
``1 / prefill_tokens_per_s`` per prefilled token. So one cell serves at most
``max_batch_size / decode_step_s`` tokens/s and one session ``1 / decode_step_s``: more
rollout cells mean more throughput, and a lone long session leaves its cell mostly idle, as
on real devices. Everything else (HTTP, the gateway, KV moves, weight loads) is real.

The engine's scheduler thread does the waiting, between two of its steps (commands such as
weight loads and aborts run at the start of a step, so they wait at most one step).
"""

from __future__ import annotations

import time

from infra.engine.engine import Engine


class PacedEngine(Engine):
    """The embedded engine with a floor on the time of each scheduler step."""

    def __init__(
        self, *args, decode_step_s: float = 0.0, prefill_tokens_per_s: float = 0.0, **kwargs
    ):
        self.decode_step_s = float(decode_step_s)
        self.prefill_s_per_token = 1.0 / prefill_tokens_per_s if prefill_tokens_per_s else 0.0
        self.paced_s = 0.0  # time spent waiting for the pace (the device was "busy")
        super().__init__(*args, **kwargs)

    def _step(self) -> None:
        t0 = time.monotonic()
        steps0 = self.stats["engine/decode_steps"]
        prefill0 = self.stats["engine/prefill_tokens"]
        super()._step()
        device_s = (self.stats["engine/decode_steps"] - steps0) * self.decode_step_s + (
            self.stats["engine/prefill_tokens"] - prefill0
        ) * self.prefill_s_per_token
        left = t0 + device_s - time.monotonic()
        if left > 0:
            self.paced_s += left
            time.sleep(left)
