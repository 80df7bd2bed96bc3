"""A robot on openpi's protocol: ``openpi-client`` (unmodified) drives a tenant's policy over the service's
WebSocket endpoint, a ManiSkill env of the service's catalog standing in for the robot.

The robot side is what an openpi robot runs: ``WebsocketClientPolicy(host, port, api_key=<token>)`` wrapped in
openpi's ``ActionChunkBroker`` (one call per action chunk, its actions executed one per step); the observation
goes out under openpi's keys (``observation/image``, ``observation/state``, ``prompt``), which the endpoint maps
to the tenant's camera, state and instruction (the metadata it sends on connect names them). Each reply carries
its ``server_timing``; a deadline per connection (``?deadline_ms=``) tells the engine when the chunk is due.

    python examples/openpi_robot.py                  # starts a local service (~1 min), 60 steps
    python examples/openpi_robot.py --steps 20 --openpi ws://127.0.0.1:PORT --token nxt_... \\
        --env maniskill/pickcube-rgb                 # against a running service's tenant of that env
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import numpy as np
from openpi_client.action_chunk_broker import ActionChunkBroker
from openpi_client.base_policy import BasePolicy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from nexus.config import catalog
from nexus.features import Observation
from nexus.sim.maniskill import ManiSkillEnv

ENV = "maniskill/pickcube-rgb"


def openpi_obs(obs: Observation, meta: dict) -> dict:
    """The simulator's observation under the keys the endpoint reads (its metadata's ``observation_keys``)."""
    out = {}
    for key, field in meta["observation_keys"].items():
        if field == "state":
            out[key] = obs.state
        elif field == "instruction":
            out[key] = obs.instruction or meta["instruction"]
        else:
            out[key] = obs.images[field.removeprefix("images.")]
    return out


def run_robot(url: str, token: str, env_name: str = ENV, steps: int = 60, deadline_ms: float = 200.0,
              seed: int = 0) -> dict:
    """``steps`` control steps of the simulated robot; returns what it saw (episodes, calls, the servers' times)."""
    env = ManiSkillEnv(catalog.env(env_name))  # first: building a simulator may hold the GIL past a keepalive ping
    obs = env.reset(seed=seed)
    policy = WebsocketClientPolicy(f"{url}/?deadline_ms={deadline_ms:g}", api_key=token)
    meta = policy.get_server_metadata()
    calls: list[dict] = []  # each call's server_timing

    class Recorded(BasePolicy):  # the broker's inner policy: the calls it makes, one per chunk
        def infer(self, obs: dict) -> dict:
            out = policy.infer(obs)
            calls.append(out["server_timing"])
            return out

    robot = ActionChunkBroker(Recorded(), action_horizon=meta["action_horizon"])
    low, high = env.action_bounds
    versions, episodes, successes, ret = set(), 0, 0, 0.0
    try:
        for _ in range(steps):
            step = robot.infer(openpi_obs(obs, meta))  # a new chunk every action_horizon steps
            versions.add(int(step["version"]))
            result = env.step(np.clip(step["actions"], low, high))
            ret += result.reward
            obs = result.obs
            if result.terminated or result.truncated:
                episodes += 1
                successes += result.success
                obs = env.reset(seed=seed + episodes)
    finally:
        env.close()
        policy._ws.close()
    return {"tenant": meta["tenant"], "version": meta["version"], "versions_acted": sorted(versions),
            "steps": steps, "calls": len(calls), "episodes_ended": episodes, "successes": successes,
            "return": round(ret, 3),
            "server_total_ms_median": round(statistics.median(c["total_ms"] for c in calls), 2),
            "server_forward_ms_median": round(statistics.median(c["forward_ms"] for c in calls), 2),
            "action_horizon": meta["action_horizon"], "deadline_ms": deadline_ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--openpi", default=None, help="the service's openpi endpoint ws://host:port (gateway.json's "
                                                  "openpi_url); default: start a local service")
    p.add_argument("--token", default=None, help="the tenant's token (with --openpi)")
    p.add_argument("--env", default=ENV, help="the catalog env standing in for the robot (the tenant's env)")
    p.add_argument("--steps", type=int, default=60, help="control steps to run")
    p.add_argument("--chunk", type=int, default=4, help="action chunk of the tenant created locally")
    p.add_argument("--deadline-ms", type=float, default=200.0)
    a = p.parse_args(argv)
    if a.openpi is not None:
        if not a.token:
            p.error("--openpi needs --token (the tenant's)")
        print(json.dumps(run_robot(a.openpi, a.token, a.env, a.steps, a.deadline_ms), indent=2))
        return 0

    from nexus.client.api import Nexus
    from nexus.gateway.openpi import openpi_address
    from nexus.spec import TenantSpec

    with tempfile.TemporaryDirectory() as root, Nexus.local(root, n_sim=1) as nx:
        tenant = nx.create_tenant(TenantSpec(name="robot", env=a.env, chunk=a.chunk, seed=1))
        url = openpi_address(nx.service.config.gateway_dir)
        print(json.dumps(run_robot(url, tenant.token, a.env, a.steps, a.deadline_ms), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
