"""The embedded engine's prefix handle: a call sends (earlier rid, k) plus only its new ids and
the engine generates on exactly context(rid)[:k] + new; an unknown handle is a 409 and the
old full-ids request still works."""

from __future__ import annotations

import asyncio

import pytest

from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.engine_api.client import EngineClient, EngineError
from tests.infra.gateway.fixtures import ScriptedEngine

pytestmark = pytest.mark.integration


def test_prefix_handle_is_token_exact_and_falls_back():
    eng = ScriptedEngine(make_tiny_model(), cell_id="a")
    srv = EngineServer(eng)
    url = srv.start()
    sp = {"max_new_tokens": 3, "temperature": 0.0}

    async def go():
        async with EngineClient(url) as c:
            first = [1, 2, 3, 4, 5]
            r1 = await c.generate(first, sp, rid="r1")
            ctx1 = first + r1["output_ids"]
            new = [7, 8]
            await c.generate(new, sp, rid="r2", prefix=("r1", len(ctx1)))
            assert eng.received["r2"] == ctx1 + new  # the textbook: the prefix then the new ids
            await c.generate([9], sp, rid="r3", prefix=("r1", 2))  # a branch inside r1
            assert eng.received["r3"] == [1, 2, 9]
            with pytest.raises(EngineError) as err:
                await c.generate(new, sp, rid="r4", prefix=("nope", 1))
            assert err.value.status == 409
            await c.generate(ctx1 + new, sp, rid="r5")  # old style: full ids
            assert eng.received["r5"] == ctx1 + new

    try:
        asyncio.run(go())
    finally:
        srv.stop()
        eng.close()
