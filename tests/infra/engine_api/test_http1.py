"""`infra.engine_api.http1`: the minimal HTTP/1.1 keep-alive client, against scripted loopback servers.

Each server is a plain asyncio TCP server that answers with bytes written by hand, so the
framing cases (chunked, split reads, close-delimited, stale keep-alive) are exact.
"""

import asyncio

import pytest

from infra.engine_api.http1 import ConnectFailed, Disconnected, Http1Pool, ReadTimeout


async def _serve(answer):
    """A server calling ``answer(head: bytes, body: bytes, writer)`` per request; it returns
    False to close the connection. Returns (server, url, per-connection request counts)."""
    conns: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(0)
        me = len(conns) - 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":")[1])
                body = await reader.readexactly(n)
                conns[me] += 1
                keep = await answer(head, body, writer)
                await writer.drain()
                if keep is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return srv, f"http://127.0.0.1:{port}", conns


def _fixed(status: int, body: bytes, extra: bytes = b"") -> bytes:
    return (
        f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n".encode() + extra + b"\r\n" + body
    )


def test_content_length_answers_reuse_one_connection():
    async def answer(head, body, w):
        w.write(_fixed(200, b'{"echo": ' + body + b"}"))

    async def go():
        srv, url, conns = await _serve(answer)
        pool = Http1Pool(url)
        outs = [await pool.request("POST", "/x", b'"%d"' % i) for i in range(5)]
        await pool.aclose()
        srv.close()
        return outs, conns

    outs, conns = asyncio.run(go())
    assert [o.body for o in outs] == [b'{"echo": "%d"}' % i for i in range(5)]
    assert all(o.status == 200 for o in outs)
    assert conns == [5]  # keep-alive


def test_chunked_body_split_across_writes_and_streamed():
    async def answer(head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 22\n\n", b"data: [DONE]\n\n"):
            frame = b"%x\r\n%s\r\n" % (len(part), part)
            for i in range(0, len(frame), 3):  # framing split at odd places
                w.write(frame[i : i + 3])
                await w.drain()
                await asyncio.sleep(0)
        w.write(b"0\r\n\r\n")

    async def go():
        srv, url, conns = await _serve(answer)
        pool = Http1Pool(url)
        whole = await pool.request("GET", "/s")
        parts = [p async for p in pool.stream("GET", "/s")]
        again = await pool.request("GET", "/s")
        await pool.aclose()
        srv.close()
        return whole, parts, again, conns

    whole, parts, again, conns = asyncio.run(go())
    text = b"data: 1\n\ndata: 22\n\ndata: [DONE]\n\n"
    assert whole.body == text and again.body == text
    assert parts[0].status == 200 and b"".join(parts[1:]) == text
    assert conns == [3]


def test_close_delimited_body_and_connection_close():
    async def answer(head, body, w):
        w.write(b"HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\nno such path")
        return False

    async def go():
        srv, url, conns = await _serve(answer)
        pool = Http1Pool(url)
        a = await pool.request("GET", "/a")
        b = await pool.request("GET", "/b")
        await pool.aclose()
        srv.close()
        return a, b, conns

    a, b, conns = asyncio.run(go())
    assert (a.status, a.reason, a.body) == (404, "Not Found", b"no such path")
    assert b.body == b"no such path" and conns == [1, 1]


def test_server_closing_idle_connection_is_not_reused():
    async def answer(head, body, w):
        w.write(_fixed(200, b"ok"))
        await w.drain()
        return False  # closes after answering, without saying so (like a keep-alive timeout)

    async def go():
        srv, url, conns = await _serve(answer)
        pool = Http1Pool(url)
        await pool.request("GET", "/a")
        await asyncio.sleep(0.05)
        b = await pool.request("GET", "/b")
        await pool.aclose()
        srv.close()
        return b, conns

    b, conns = asyncio.run(go())
    assert b.body == b"ok" and conns == [1, 1]


def test_disconnect_mid_body_and_read_timeout():
    async def answer(head, body, w):
        if b"/short" in head:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            return False
        await asyncio.sleep(5)

    async def go():
        srv, url, _ = await _serve(answer)
        pool = Http1Pool(url, read_timeout=0.2)
        with pytest.raises(Disconnected):
            await pool.request("GET", "/short")
        with pytest.raises(ReadTimeout):
            await pool.request("GET", "/slow")
        assert not pool._idle  # neither broken connection went back to the pool
        await pool.aclose()
        srv.close()

    asyncio.run(go())


def test_connect_refused_and_cancel_closes_the_connection(free_port):
    async def go():
        pool = Http1Pool(f"http://127.0.0.1:{free_port()}", connect_timeout=1)
        with pytest.raises(ConnectFailed):
            await pool.request("GET", "/health")
        hung_up = asyncio.Event()

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await reader.read()  # until the client hangs up
            hung_up.set()
            writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        pool = Http1Pool(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
        task = asyncio.ensure_future(pool.request("POST", "/generate", b"{}"))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.wait_for(hung_up.wait(), 5)  # the server sees the hang-up (it aborts)
        await pool.aclose()
        srv.close()

    asyncio.run(go())


def test_large_binary_body_both_ways():
    blob = bytes(range(256)) * 8192  # 2 MiB

    async def answer(head, body, w):
        assert b"application/octet-stream" in head
        w.write(_fixed(200, body[::-1]))

    async def go():
        srv, url, _ = await _serve(answer)
        pool = Http1Pool(url)
        r = await pool.request("POST", "/kv", blob, content_type="application/octet-stream")
        await pool.aclose()
        srv.close()
        return r

    assert asyncio.run(go()).body == blob[::-1]


def test_connection_idle_too_long_is_replaced():
    async def answer(head, body, w):
        w.write(_fixed(200, b"ok"))

    async def go():
        srv, url, conns = await _serve(answer)
        pool = Http1Pool(url, max_idle_s=0.05)
        await pool.request("GET", "/a")
        await pool.request("GET", "/b")  # reused at once
        await asyncio.sleep(0.1)
        await pool.request("GET", "/c")  # older than max_idle_s: a new connection
        await pool.aclose()
        srv.close()
        return conns

    assert asyncio.run(go()) == [2, 1]
