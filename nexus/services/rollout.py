"""Rollout producers: tasks on ``SIM`` workers that run a tenant's policy in its simulator.

Each step's action comes from the inference engine (a direct actor call); finished episodes go
to the tenant's Arrow trajectory store, and only a small reference to the batch goes back.
Module-level imports stay light (the scheduler names these functions).
"""

from __future__ import annotations

import json
import time
from typing import Any

from nexus.signals import emit


def _env(name: str):
    """The simulator of a catalog env, reused across the tasks of this worker process (its plugin holds it)."""
    from nexus.services.worker_plugin import state

    return state().env(name)


def collect(tenant: str, env_name: str, output_dir: str, schema: dict, episodes: int, seed: int,
            episode_offset: int, deterministic: bool, version: int | None, engine,
            job: str | None = None) -> dict[str, Any]:
    """Run ``episodes`` episodes (ids from ``episode_offset``); RL batches are stored, eval
    episodes (pinned ``version``) are not."""
    t_start = time.time()  # the whole task is the tenant's simulator time, imports included
    import torch

    from nexus.control.validation import schema_from_dict
    from nexus.data.output_dir import TenantOutputDir
    from nexus.data.trajectory_store import TrajectoryStore
    from nexus.services.environment import PolicyOutput, collect_episodes, episode_stats

    torch.set_num_threads(1)
    env = _env(env_name)
    wait_s = 0.0

    class EnginePolicy:
        """Actions from the inference engine; ``batch`` asks for all sub-envs of a vector env at once
        (the requests overlap, so the engine can group them into one backbone forward)."""

        def __call__(self, obs) -> PolicyOutput:
            return self.batch([obs])[0]

        def batch(self, observations: list) -> list[PolicyOutput]:
            nonlocal wait_s
            t0 = time.perf_counter()
            futures = [engine.predict(tenant, obs, version, deterministic, job) for obs in observations]
            outs = [f.result() for f in futures]
            wait_s += time.perf_counter() - t0
            return [PolicyOutput(action=o["action"], logprob=o["logprob"], value=o["value"], version=o["version"])
                    for o in outs]

    policy = EnginePolicy()

    t0 = time.perf_counter()
    columns = collect_episodes(env, policy, episodes=episodes, seed=seed, tenant=tenant,
                               episode_offset=episode_offset)
    busy = time.perf_counter() - t0
    stats = episode_stats(columns) | {"sim_s": busy - wait_s, "inference_wait_s": wait_s}
    result: dict[str, Any] = {"stats": stats,
                              "versions": sorted({int(v) for v in columns["policy_version"]})}
    if version is None:
        store = TrajectoryStore(TenantOutputDir(output_dir).trajectories, tenant, schema_from_dict(schema))
        result["batch"] = store.append(columns).to_dict()
    # the simulator slot is the tenant's for the whole task, waits for actions included
    emit("rollout", tenant=tenant, job=job, t0=t_start, t1=time.time(), what="rl" if version is None else "eval",
         steps=int(stats["steps"]))
    return result


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Episode statistics of several rollout tasks, weighted by their episode counts."""
    episodes = sum(p["episodes"] for p in parts)
    if episodes == 0:
        return {"episodes": 0, "steps": 0, "mean_return": 0.0, "success_rate": 0.0}
    return {"episodes": episodes, "steps": sum(p["steps"] for p in parts),
            "mean_return": sum(p["mean_return"] * p["episodes"] for p in parts) / episodes,
            "success_rate": sum(p["success_rate"] * p["episodes"] for p in parts) / episodes}


def write_eval_report(output_dir: str, report: dict[str, Any]) -> str:
    from nexus.data.output_dir import TenantOutputDir, atomic_write_bytes

    path = TenantOutputDir(output_dir).eval_dir / f"{report['job']}-v{report['version']:06d}.json"
    atomic_write_bytes(path, json.dumps(report, indent=2).encode())
    return str(path)
