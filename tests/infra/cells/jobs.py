"""A thread future as the executor's ``Job`` (``done``, ``result``, ``add_done_callback``):
what the cells tests hand the executor instead of a Prefect future."""

from __future__ import annotations


class FutureJob:
    def __init__(self, fut):
        self.fut = fut

    def done(self) -> bool:
        return self.fut.done()

    def result(self):
        return self.fut.result()

    def add_done_callback(self, fn) -> None:
        self.fut.add_done_callback(lambda _f: fn())
