"""A robot over gRPC: a simulated robot loop drives its tenant's policy through the gateway's gRPC API
(``joynexus.v1.RobotPolicy``) and uploads its episodes into the tenant's RL.

A ManiSkill env of the catalog (``maniskill/pushcube-state`` by default) stands in for the robot: each step the
robot sends its observation on one open ``Act`` stream and gets an action chunk back (a sample, with its
log-probability and the policy version that acted), executes it, and records the step; whole episodes go to
an RL job with ``rollouts="external"`` through ``UploadEpisodes`` (the HTTP upload's checks, store and staleness
rule). ``--steps`` bounds the loop.

    python examples/grpc_robot.py --steps 60       # starts a local service with the gRPC API (~1 min)
    python examples/grpc_robot.py --grpc 127.0.0.1:PORT --token nxt_... --tenant robot --job JOB --steps 60
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from nexus.client.grpc_robot import RobotClient, grpc_target
from nexus.client.rollouts import EpisodeBuffer
from nexus.config.catalog import env as catalog_env
from nexus.sim.vector import make_single


def run(target: str, token: str, tenant: str, job: str | None, env_name: str, steps: int,
        episode_steps: int = 20, seed: int = 0, ca: str | None = None, max_uploads: int | None = None) -> dict:
    """``steps`` robot steps; each finished episode (at most ``episode_steps`` long) uploaded to ``job`` (the first
    ``max_uploads``: the job trains that many updates, then takes no more)."""
    robot = make_single(catalog_env(env_name))
    low, high = robot.action_bounds
    client = RobotClient(target, token, ca=ca)
    info = client.info(tenant)
    buf, uploads, latencies, episodes, returns = EpisodeBuffer(), [], [], 0, [0.0]
    try:
        with client.session(tenant) as policy:
            obs, t = robot.reset(seed=seed), 0
            for _ in range(steps):
                t0 = time.perf_counter()
                out = policy.act({"state": obs.state, "images": obs.images, "instruction": obs.instruction},
                                 sample=True)
                latencies.append(1e3 * (time.perf_counter() - t0))
                action = out["actions"][0]  # RL trains one action per step (chunk 1)
                res = robot.step(np.clip(action, low, high))
                t += 1
                returns[-1] += res.reward
                done = res.terminated or res.truncated or t >= episode_steps
                buf.add(obs, {"action": action, "logprob": out["logprob"], "value": out["value"],
                              "version": out["version"]}, res.reward, res.terminated, done and not res.terminated,
                        res.success)
                obs = res.obs
                if done:
                    episodes += 1
                    if job is not None and (max_uploads is None or len(uploads) < max_uploads):
                        uploads.append(client.upload(job, buf))
                    buf.clear()
                    obs, t = robot.reset(seed=seed + episodes), 0
                    returns.append(0.0)
    finally:
        client.close()
        robot.close()
    return {"tenant": tenant, "version": info["version"], "steps": steps, "episodes": episodes,
            "returns": [round(r, 3) for r in returns[:episodes]], "uploads": len(uploads),
            "uploaded_rows": sum(u["rows"] for u in uploads),
            "act_ms_median": float(np.median(latencies)) if latencies else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc", help="a running gateway's gRPC address (default: start a local service)")
    p.add_argument("--token", help="the tenant's token (with --grpc)")
    p.add_argument("--ca", help="the service CA (PEM) of a TLS gateway")
    p.add_argument("--tenant", default="robot")
    p.add_argument("--job", help="the tenant's RL job with rollouts='external' (with --grpc; default: none)")
    p.add_argument("--env", default="maniskill/pushcube-state", help="the catalog env standing in for the robot")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--episode-steps", type=int, default=20)
    p.add_argument("--updates", type=int, default=2, help="updates of the RL job (one per uploaded episode)")
    a = p.parse_args()
    if a.grpc:
        out = run(a.grpc, a.token, a.tenant, a.job, a.env, a.steps, a.episode_steps, ca=a.ca, max_uploads=a.updates)
    else:
        from nexus.client.api import Nexus
        from nexus.spec import TenantSpec

        with Nexus.local("runs/examples-grpc", grpc_port=0) as nx:
            t = nx.create_tenant(TenantSpec(name=a.tenant, env=a.env, seed=1))
            job = t.rl(updates=a.updates, rollouts="external")
            out = run(grpc_target(nx.service.config.gateway_dir), t.token, a.tenant, job.id, a.env, a.steps,
                      a.episode_steps, max_uploads=a.updates)
            out["job"] = job.result(timeout=600) if out["uploads"] == a.updates else job.cancel()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
