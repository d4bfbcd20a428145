"""A training member loads its samples through the store's retries: an outage ends as the
store's own `StoreError` (outage=True, which `gyre run` names as a store outage with the
command to resume), not as a raw connection error that reads as a failed member; a segment
that cannot be decoded is quarantined and refused by name."""

from __future__ import annotations

import pytest

from storage.store import Store, StoreError
from tasks.train_step import load_samples
from tests.s3 import moto_s3

pytestmark = [pytest.mark.fault, pytest.mark.integration]


def _a_segment(st: Store, dataset: str, column: str) -> str:
    seg = st.append(dataset, [{column: "x"}])
    assert seg is not None
    return seg


def test_loading_samples_in_an_outage_is_the_stores_error(free_port):
    with moto_s3(free_port(), buckets=("bkt",)) as server:
        st = Store("s3://bkt/r", retry_s=1.5)
        seg = _a_segment(st, "samples", "session_id")
        server.stop()
        with pytest.raises(StoreError, match="kept failing") as err:
            load_samples(st, seg)
        assert err.value.outage


def test_an_undecodable_samples_segment_is_refused_and_quarantined(tmp_path):
    st = Store(str(tmp_path / "store"))
    seg = _a_segment(st, "samples", "session_id")
    with open(seg, "wb") as fh:
        fh.write(b"not parquet")
    with pytest.raises(StoreError) as err:
        load_samples(st, seg)
    assert str(err.value) == (
        f"store: samples segment {seg} cannot be decoded; it was moved to _quarantine/ and "
        "its samples are not trained"
    )
    assert st.segments("samples") == []
