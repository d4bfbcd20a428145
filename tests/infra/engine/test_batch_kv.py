"""BatchKV: rows keep their exact KV through joins, leaves, growth and padding trims."""

import torch

from infra.engine.batch_kv import BatchKV


def row(n, tag):
    """KV (L=2, 2, H=2, n, D=3) whose entries identify the row and position."""
    base = torch.arange(n, dtype=torch.float32) + 1000 * tag
    return base.view(1, 1, 1, n, 1).expand(2, 2, 2, n, 3).clone()


def test_join_leave_grow_and_trim_preserve_rows():
    batch = BatchKV(like=row(1, 0))
    rows = {}
    for tag, n in enumerate([5, 40, 3, 300, 7, 12]):  # 300 > end forces a re-layout
        rows[tag] = row(n, tag)
        batch.add(rows[tag])
    order = list(rows)  # the engine's request list mirrors the rows
    assert len(batch) == 6 and batch.end == 300
    for b, tag in enumerate(order):
        assert torch.equal(batch.row(b), rows[tag])
    # leave: the last row moves into the freed slot
    out = batch.remove(1)
    assert torch.equal(out, rows[1])
    order[1] = order[-1]
    order.pop()
    for b, tag in enumerate(order):
        assert torch.equal(batch.row(b), rows[tag])
    # the 300-token row leaves: padding is trimmed (end shrinks to the longest live row)
    b300 = order.index(3)
    batch.remove(b300)
    order[b300] = order[-1]
    order.pop()
    assert batch.end == 12
    for b, tag in enumerate(order):
        assert torch.equal(batch.row(b), rows[tag])


def test_mask_and_decode_write_position():
    batch = BatchKV(like=row(1, 0))
    batch.add(row(2, 1))
    batch.add(row(4, 2))
    mask = batch.attention_mask(torch.float32)[:, 0, 0]  # (B, end + 1)
    neg = torch.finfo(torch.float32).min
    assert mask.tolist() == [[neg, neg, 0, 0, 0], [0, 0, 0, 0, 0]]
    batch.ensure_room(1)
    cache = batch.cache()
    k_new = torch.full((2, 2, 1, 3), 7.0)
    keys, _ = cache.layers[0].update(k_new, k_new)
    assert keys.shape == (2, 2, 5, 3) and torch.equal(keys[:, :, 4], k_new[:, :, 0])
    batch.advance(1)
    assert batch.lens == [3, 5] and batch.end == 5
    assert torch.equal(batch.row(0)[0, 0, :, -1], torch.full((2, 3), 7.0))
