"""The cells of a run on the engines users have: Kubernetes (dask-kubernetes) and Slurm
(dask-jobqueue). What ``tests/flows/test_netns_run.py`` starts by hand on namespaces, and
README "Running on a cluster" walks through: a scheduler that drops a silent worker, one
worker per cell with the threads a cell needs, and on every worker what the cells must
reach (the Prefect API, the store's endpoint and credentials).

Neither package is a dependency of gyre: `kube_spec` imports ``dask_kubernetes`` when
called, and `slurm_kwargs` is plain keyword arguments for ``dask_jobqueue.SLURMCluster``.
"""

from __future__ import annotations

from typing import Any

from infra.cells.config import ClusterConfig

# the scheduler drops a worker it has not heard from for this long (Dask's default is 5
# minutes): a node or pod that fell off the network is then a lost cell, healed by a new one
WORKER_TTL = "60s"
TTL_ENV = "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL"


def worker_threads(cfg: ClusterConfig, groups_per_cell: int) -> int:
    """A cell's threads: its work plus one per harness slot (``scheduler.groups_per_cell``)."""
    return cfg.threads_per_cell + groups_per_cell


def worker_env(prefect_api_url: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """What every worker needs: the Prefect API, plus the store's variables (``env``: e.g.
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``; better from a Kubernetes secret)."""
    return {"PREFECT_API_URL": prefect_api_url, "OMP_NUM_THREADS": "1", **(env or {})}


def kube_spec(
    cfg: ClusterConfig,
    *,
    name: str,
    image: str,
    prefect_api_url: str,
    groups_per_cell: int = 2,
    env: dict[str, str] | None = None,
    cpu: str = "4",
    memory: str = "16Gi",
    gpus_per_cell: int = 0,
) -> dict[str, Any]:
    """A ``DaskCluster`` resource (the dask-kubernetes operator's) with one worker pod per
    cell: ``kubectl apply`` it as YAML, or pass it to ``KubeCluster(custom_cluster_spec=)``.
    The run then goes on a pod in the cluster with ``cluster.scheduler_address=
    tcp://{name}-scheduler:8786`` and ``cluster.advertise_host`` set to its pod IP."""
    from dask_kubernetes.operator import make_cluster_spec

    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus_per_cell:
        limits["nvidia.com/gpu"] = gpus_per_cell  # a cell never spans nodes
    command = ["dask-worker", "--nthreads", str(worker_threads(cfg, groups_per_cell))]
    command += ["--memory-limit", cfg.memory_limit]
    spec = make_cluster_spec(
        name=name,
        image=image,
        n_workers=cfg.rollout_cells + cfg.train_cells,
        resources={"limits": limits},
        env=worker_env(prefect_api_url, env),
        worker_command=" ".join(command),
    )
    for c in spec["spec"]["scheduler"]["spec"]["containers"]:
        c.setdefault("env", []).append({"name": TTL_ENV, "value": WORKER_TTL})
    return spec


def slurm_kwargs(
    cfg: ClusterConfig,
    *,
    advertise_host: str,
    prefect_api_url: str,
    groups_per_cell: int = 2,
    memory: str = "32GB",
    walltime: str = "12:00:00",
    interface: str | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``dask_jobqueue.SLURMCluster``: one job per cell (scale it to
    ``cluster.rollout_cells + cluster.train_cells`` jobs), its scheduler bound to
    ``advertise_host`` (the run's host, as the compute nodes reach it; the same as the
    run's ``cluster.advertise_host``), ``interface``: the nodes' network for the workers
    (``ib0``). Keep the Python process that owns the cluster alive during the run."""
    exports = [f"export {k}={v}" for k, v in worker_env(prefect_api_url, env).items()]
    kw: dict[str, Any] = {
        "cores": worker_threads(cfg, groups_per_cell),
        "processes": 1,  # one worker process per job: a cell
        "memory": memory,
        "walltime": walltime,
        "job_script_prologue": exports,
        "scheduler_options": {"host": advertise_host, "dashboard_address": f"{advertise_host}:0"},
    }
    if interface is not None:
        kw["interface"] = interface
    return kw


def slurm_scheduler_env() -> dict[str, str]:
    """Set in the process that owns the SLURMCluster (its scheduler runs there)."""
    return {TTL_ENV: WORKER_TTL}
