"""The recipes for Kubernetes and Slurm (infra/cells/recipes.py), checked as far as they can
be without a cluster: our keyword arguments always; the ``DaskCluster`` resource that
dask-kubernetes renders and the job script that dask-jobqueue renders where those packages
are installed (neither is a dependency of gyre: those tests skip, saying so, without them).
"""

from __future__ import annotations

import pytest
import yaml

from infra.cells.config import ClusterConfig
from infra.cells.recipes import TTL_ENV, WORKER_TTL, kube_spec, slurm_kwargs, worker_threads

CFG = ClusterConfig(rollout_cells=3, train_cells=1, threads_per_cell=2)
API = "http://10.0.0.1:4200/api"
STORE = {"AWS_ENDPOINT_URL": "http://minio:9000"}


def test_slurm_kwargs_make_one_cell_per_job_that_reaches_the_run():
    kw = slurm_kwargs(CFG, advertise_host="10.0.0.1", prefect_api_url=API, env=STORE)
    assert kw["processes"] == 1 and kw["cores"] == worker_threads(CFG, 2) == 4
    assert f"export PREFECT_API_URL={API}" in kw["job_script_prologue"]
    assert "export AWS_ENDPOINT_URL=http://minio:9000" in kw["job_script_prologue"]
    assert kw["scheduler_options"]["host"] == "10.0.0.1"
    assert "interface" not in kw
    assert (
        slurm_kwargs(CFG, advertise_host="h", prefect_api_url=API, interface="ib0")["interface"]
        == "ib0"
    )


def test_the_slurm_job_script_dask_jobqueue_renders():
    jobqueue = pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is not installed")
    kw = slurm_kwargs(CFG, advertise_host="127.0.0.1", prefect_api_url=API, env=STORE)
    cluster = jobqueue.SLURMCluster(**kw)
    try:
        script = cluster.job_script()
    finally:
        cluster.close()
    lines = script.splitlines()
    assert lines[0].startswith("#!")
    assert "#SBATCH --cpus-per-task=4" in lines and "#SBATCH -t 12:00:00" in lines
    assert f"export PREFECT_API_URL={API}" in lines
    worker = next(x for x in lines if "dask_worker tcp:" in x or "dask-worker tcp:" in x)
    assert "tcp://127.0.0.1:" in worker and "--nthreads 4" in worker
    # every prologue line comes before the worker starts
    assert lines.index(f"export PREFECT_API_URL={API}") < lines.index(worker)


def test_the_kubernetes_cluster_spec_dask_kubernetes_renders():
    pytest.importorskip("dask_kubernetes.operator", reason="dask-kubernetes is not installed")
    spec = kube_spec(
        CFG, name="gyre", image="gyre:test", prefect_api_url=API, env=STORE, gpus_per_cell=1
    )
    spec = yaml.safe_load(yaml.safe_dump(spec))  # what `kubectl apply -f` reads
    assert spec["apiVersion"] == "kubernetes.dask.org/v1" and spec["kind"] == "DaskCluster"
    worker = spec["spec"]["worker"]
    assert worker["replicas"] == CFG.rollout_cells + CFG.train_cells
    (c,) = worker["spec"]["containers"]
    assert c["image"] == "gyre:test"
    assert c["args"][:5] == ["dask-worker", "--nthreads", "4", "--memory-limit", "6GiB"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["PREFECT_API_URL"] == API and env["AWS_ENDPOINT_URL"] == STORE["AWS_ENDPOINT_URL"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    (s,) = spec["spec"]["scheduler"]["spec"]["containers"]
    assert {"name": TTL_ENV, "value": WORKER_TTL} in s["env"]
    ports = {p["name"]: p["port"] for p in spec["spec"]["scheduler"]["service"]["ports"]}
    assert ports == {"tcp-comm": 8786, "http-dashboard": 8787}
