"""prefect.yaml stays deployable: entrypoints, parameters, concurrency, the Run form.

(The deployments run for real, through the Prefect API and a worker, in
tests/flows/test_deploy_run.py, marker ``deploy``.)
"""

import importlib
import inspect
from pathlib import Path

import yaml

from flows.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _deployments() -> dict[str, dict]:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {d["name"]: d for d in spec["deployments"]}


def _flow(dep: dict):
    module, name = dep["entrypoint"].split(":")
    return getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), name)


def test_prefect_yaml_deployments():
    deps = _deployments()
    assert set(deps) == {"gyre-rl", "gyre-nightly"}
    for dep in deps.values():
        flow = _flow(dep)
        assert flow.name == "rl_run"
        params = dep["parameters"]
        assert set(params) <= set(inspect.signature(flow.fn).parameters)
        load_config(preset=params["preset"], overrides=params["overrides"], store=params["store"])
        assert dep["concurrency_limit"] == 1  # one run at a time
        # no schedule declared: `prefect deploy --all` then keeps the one a user made
        assert "schedules" not in dep and "schedule" not in dep
        assert dep["work_pool"]["name"] == "gyre"
    nightly = deps["gyre-nightly"]["parameters"]
    assert nightly["run_id"] and nightly["resume"] is True and nightly["more_steps"] > 0
    for mode in ("colocate", "async", "async-stream", "elastic"):  # what the Run form takes
        cfg = load_config(preset="tiny", overrides=[f"scheduler.mode={mode}"])
        assert cfg.scheduler.mode == mode


def test_run_form_describes_every_parameter():
    """The UI's Run form: the preset is a choice, every field says what it takes."""
    from prefect.utilities.callables import parameter_schema

    from flows.config import PRESETS
    from flows.rl_run import rl_run

    props = parameter_schema(rl_run).model_dump()["properties"]
    assert set(props) == set(inspect.signature(rl_run.fn).parameters)
    assert all(p.get("description") for p in props.values()), props
    (choice,) = [a for a in props["preset"]["anyOf"] if "enum" in a]
    assert sorted(choice["enum"]) == sorted(PRESETS)
    assert "key=value" in props["overrides"]["description"]
