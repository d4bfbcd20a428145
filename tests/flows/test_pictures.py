"""What a run shows in the Prefect UI: pictures that load, with axes, legend and title;
artifacts on the run a user opens, keyed per run; counts not rounded; preset help true."""

from __future__ import annotations

import base64
import re
import struct
from types import SimpleNamespace

import pytest

from flows.evaluation import learning_figure, write_learning
from flows.progress import image_markdown, plain, rounded, summary_markdown
from flows.report import png, roles_figure, write_report
from storage.store import Store


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _data_uri_png(markdown: str) -> bytes:
    """The one embedded PNG of an artifact's markdown (no file:// or other links)."""
    assert "file://" not in markdown
    (uri,) = re.findall(r"!\[[^\]]*\]\((data:image/png;base64,[A-Za-z0-9+/=]+)\)", markdown)
    return base64.b64decode(uri.split(",", 1)[1], validate=True)


TIMELINE = [
    {"cell": 0, "t": 0.0, "event": "join", "role": "rollout"},
    {"cell": 1, "t": 0.0, "event": "join", "role": "train"},
    {"cell": 1, "t": 2.0, "event": "step", "role": "train"},
    {"cell": 1, "t": 5.0, "event": "step_done", "role": "train"},
    {"cell": 0, "t": 6.0, "event": "decide", "role": "draining"},
    {"cell": 0, "t": 7.0, "event": "role", "role": "train"},
]


def _texts(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def test_role_timeline_names_cells_has_time_axis_legend_and_title():
    fig = roles_figure(TIMELINE, ["cell-a", "cell-b"], 10.0, "run x (elastic)")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["cell-b", "cell-a"]  # a on top
    assert "seconds" in ax.get_xlabel() and ax.get_ylabel() == "cell"
    assert ax.get_title() == "run x (elastic)"
    labels = _texts(ax)
    assert {"rollout (serving)", "train (idle)", "in an optimizer step", "draining"} <= set(
        labels
    ) and "role change decided" in labels
    w, h = _png_size(png(TIMELINE, ["cell-a", "cell-b"], 10.0, "t"))
    assert w >= 600 and h >= 150


def test_learning_curve_shows_loss_and_lag_with_labelled_axes():
    curve = [{"step": 0, "reward": 0.2, "se": 0.05}, {"step": 4, "reward": 0.6, "se": 0.04}]
    train = [{"step": 0, "reward": 0.1}, {"step": 3, "reward": 0.5}]
    steps = [{"step": s, "loss": 1.0 - s / 10, "lag_mean": s % 2} for s in range(4)]
    fig = learning_figure(curve, train, "t", steps)
    top, bottom, lag = fig.axes
    assert top.get_ylabel() == "reward" and top.get_xlabel() == "optimizer steps"
    assert bottom.get_ylabel() == "training loss" and bottom.get_xlabel() == "optimizer steps"
    assert "lag" in lag.get_ylabel()
    assert len(_texts(top)) == 2 and _texts(bottom) == [
        "loss",
        "policy lag of trained tokens, mean",
    ]
    assert [round(y, 3) for y in bottom.lines[0].get_ydata()] == [1.0, 0.9, 0.8, 0.7]


def test_image_markdown_embeds_the_png_as_a_data_uri():
    picture = png(TIMELINE, ["a", "b"], 10.0)
    assert _data_uri_png(image_markdown(picture, "role timeline")) == picture


def test_counts_stay_integers_in_the_summary():
    import decimal

    assert plain(decimal.Decimal(230096)) == 230096 and isinstance(plain(decimal.Decimal(3)), int)
    assert plain(decimal.Decimal("0.5")) == 0.5
    assert rounded(230096.0) == 230096 and rounded(0.123456) == 0.1235
    md = summary_markdown({"tokens_unique": plain(decimal.Decimal(230096))}, "s", "r")
    assert "| tokens_unique | 230096 |" in md


def test_preset_help_is_true_to_each_preset():
    from prefect.utilities.callables import parameter_schema

    from flows.cli import build_parser
    from flows.config import PRESETS, load_config
    from flows.rl_run import rl_run

    form = parameter_schema(rl_run).model_dump()["properties"]["preset"]["description"]
    run_help = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    run_help = " ".join(run_help.split())
    for name in PRESETS:
        cfg = load_config(preset=name)
        said = f"{name} ({cfg.rollout.suite}, {cfg.train.steps} steps"
        assert said in form and said in run_help, (said, form)


class _Stats(SimpleNamespace):
    pass


def _executor():
    stats = _Stats(
        switch_latency_s=[0.5], steps=2, groups_done=3, switches=1, sessions_rerouted=0,
        kv_moved=0, kv_tokens=0, reprefills=0, weight_loads=1,
    )  # fmt: skip
    return SimpleNamespace(
        addrs=["a", "b"], cell_id=lambda i: f"cell-{i}", timeline=TIMELINE, stats=stats
    )


@pytest.mark.integration
def test_artifacts_are_on_the_parent_run_keyed_per_run_with_pictures(prefect_harness, tmp_path):
    """A sub-flow's pictures and progress land on the run a user opens (the parent flow
    run), under keys that name the run, with the PNG embedded."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.progress import Progress
    from tests.flows.test_learning import _evals

    st = Store(str(tmp_path / "store"))
    st.append("evals", _evals("r1", {0: [("a", 0.25)], 3: [("a", 0.75)]}))

    @flow
    def child(run_id: str) -> None:
        Progress(run_id, 0, 2).update(2, 0.5)
        write_report(_executor(), st, run_id, 10.0, "elastic")
        write_learning(st, run_id, {"run_id": run_id})

    @flow
    def parent(run_id: str) -> str:
        from prefect.runtime import flow_run

        child(run_id)
        return flow_run.id

    ids = {rid: parent(rid) for rid in ("r1", "R.2")}
    with get_client(sync_client=True) as client:
        for rid, key in (("r1", "r1"), ("R.2", "r-2")):
            keys = [f"gyre-{k}-{key}" for k in ("progress", "cells", "learning")]
            arts = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys))
            )
            by_key = {a.key: a for a in arts}
            want = keys if rid == "r1" else keys[:2]  # R.2 has no evaluations
            assert sorted(by_key) == sorted(want), by_key
            assert {str(a.flow_run_id) for a in arts} == {str(ids[rid])}
            _png_size(_data_uri_png(by_key[f"gyre-cells-{key}"].data))
            if rid == "r1":
                _png_size(_data_uri_png(by_key["gyre-learning-r1"].data))
