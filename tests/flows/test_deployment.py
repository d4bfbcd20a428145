"""prefect.yaml stays deployable: entrypoint, parameters and schedule are valid."""

import importlib
import inspect
from pathlib import Path

import yaml

from flows.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_prefect_yaml_deployment():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (dep,) = spec["deployments"]
    module, name = dep["entrypoint"].split(":")
    flow = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), name)
    assert flow.name == "rl_run"
    params = dep["parameters"]
    assert set(params) <= set(inspect.signature(flow.fn).parameters)
    load_config(preset=params["preset"], overrides=params["overrides"], store=params["store"])
    for mode in ("colocate", "async", "async-stream", "elastic"):  # what the Run form takes
        cfg = load_config(preset=params["preset"], overrides=[f"scheduler.mode={mode}"])
        assert cfg.scheduler.mode == mode
    (sched,) = dep["schedules"]
    assert sched["active"] is False and len(sched["cron"].split()) == 5
    from prefect.client.schemas.schedules import CronSchedule

    CronSchedule(cron=sched["cron"], timezone=sched["timezone"])
