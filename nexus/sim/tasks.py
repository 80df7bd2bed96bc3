"""Tasks of the simulator workers (resource ``SIM``), each given the worker's :class:`SimHost`."""

from __future__ import annotations

import time

from distributed import get_worker
from distributed.worker import thread_state

from nexus.sim import rollout
from nexus.sim.host import SimHost
from nexus.wire import devices
from nexus.wire.engine_client import EngineClient
from nexus.wire.messages import RolloutRequest, RolloutResult


def run_rollout(sim: SimHost, req: RolloutRequest) -> RolloutResult:
    """A rollout producer: the tenant's episodes, each action from its (re-routable) inference engine.

    The whole task is the tenant's simulator time, from the moment Dask started it (imports included). A model
    of the worker's devices may run it instead (:mod:`nexus.wire.devices`)."""
    modelled = devices.installed().run_rollout(sim, req)
    if modelled is not None:
        return modelled
    t_start = getattr(thread_state, "start_time", None) or time.time()
    import torch

    torch.set_num_threads(1)
    kind = "rollout" if req.version is None else "eval"
    datapath = req.datapath
    if req.tenant.spec.lora is not None:  # a LoRA tenant's update recomputes its features through the adapter
        datapath = datapath.model_copy(update={"cache_features": False})
    with sim.producer(f"{req.job}:{req.offset}", req.job or "", req.tenant.name, kind) as progress:
        routes = {req.tenant.name: req.route} if req.route is not None else None
        engine = EngineClient(get_worker(), routes=routes, on_answer=progress.tick)
        return rollout.collect(sim.pool, req.tenant.name, req.env, req.tenant.output_dir, req.tenant.schema,
                               req.episodes, req.seed, req.offset, req.deterministic, req.version, engine, req.job,
                               datapath, t_start, stopped=lambda: progress.stopped, group_size=req.group_size,
                               reward=req.tenant.spec.reward)


def prewarm(sim: SimHost, env_name: str, envs: int, waves: int = 1, vector_mode: str = "lockstep") -> int:
    """Build a producer's envs in this worker's pool ahead of its first rollout (``rollout.prewarm``)."""
    return rollout.prewarm(sim.pool, env_name, envs, waves, vector_mode)
