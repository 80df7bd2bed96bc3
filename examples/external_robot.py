"""External-robot-style RL: your own environment (here a tiny gymnasium env in this process, standing in for a
robot the service cannot host) drives an RL job of the service.

The loop: actions from the service's policy (``predict_batch``: each with its log-probability, value and the
policy version it came from), your env steps, whole episodes uploaded to an RL job with ``rollouts="external"``
(each upload one PPO update, stored in the tenant's trajectory store first). The tenant declares the env's
observation/action schema with ``TenantSpec(external=ExternalEnv(...))``.

    python examples/external_robot.py                       # starts a local service (~1 min), 10 updates
    python examples/external_robot.py --url http://127.0.0.1:PORT --updates 2
"""

from __future__ import annotations

import argparse
import json

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from nexus.algorithms.ppo import PPOConfig
from nexus.client.api import Nexus
from nexus.client.rollouts import EpisodeBuffer
from nexus.features import Observation
from nexus.spec import ExternalEnv, RLJob, TenantSpec


class ReachEnv(gym.Env):
    """A 1-D "robot": move the hand x to the goal g in [-2, 2]. State [x, g], action a in [-1, 1] (x += 0.5 a),
    reward -|x - g| per step, 10 steps. Standing still scores -10 on average; heading for the goal about -2."""

    metadata = {"render_modes": []}
    steps = 10

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-4.0, 4.0, (2,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.x, self.g, self.t = 0.0, float(self.np_random.uniform(-2.0, 2.0)), 0
        return self._obs(), {}

    def step(self, action):
        self.x = float(np.clip(self.x + 0.5 * float(np.clip(action[0], -1, 1)), -4.0, 4.0))
        self.t += 1
        reward = -abs(self.x - self.g)
        return self._obs(), reward, False, self.t >= self.steps, {"success": abs(self.x - self.g) < 0.25}

    def _obs(self) -> np.ndarray:
        return np.asarray([self.x, self.g], np.float32)


SCHEMA = ExternalEnv(proprio_dim=2, action_dim=1, instruction="move the hand to the goal")


def episodes(tenant, seeds: list[int], deterministic: bool, buffer: EpisodeBuffer | None = None) -> list[float]:
    """One episode per seed, the envs stepped together (one predict_batch per step); returns their returns."""
    envs = [ReachEnv() for _ in seeds]
    obs = [env.reset(seed=s)[0] for env, s in zip(envs, seeds, strict=True)]
    own = [EpisodeBuffer() for _ in seeds]
    returns = [0.0] * len(seeds)
    running = list(range(len(seeds)))
    while running:
        outs = tenant.predict_batch([Observation(state=obs[i]) for i in running],
                                    deterministic=deterministic).result()
        for i, out in zip(list(running), outs, strict=True):
            nxt, r, term, trunc, info = envs[i].step(np.clip(out["action"], -1.0, 1.0))
            own[i].add(Observation(state=obs[i]), out, r, term, trunc, info["success"])
            returns[i] += r
            obs[i] = nxt
            if term or trunc:
                running.remove(i)
    if buffer is not None:
        for b in own:
            buffer.extend(b)
    return returns


def run(nx: Nexus, tenant: str = "robot", updates: int = 16, episodes_per_update: int = 16,
        eval_seeds: int = 16) -> dict:
    t = nx.create_tenant(TenantSpec(name=tenant, external=SCHEMA, hidden_dim=64, lr=1e-3, seed=1))
    test = list(range(10_000, 10_000 + eval_seeds))  # fixed goals, never trained on
    before = float(np.mean(episodes(t, test, deterministic=True)))
    job = t.submit(RLJob(updates=updates, episodes_per_batch=episodes_per_update, rollouts="external",
                         ppo=PPOConfig(gamma=0.9, update_epochs=8, minibatch_size=64)))
    buf = EpisodeBuffer()
    for u in range(updates):
        seeds = list(range(u * episodes_per_update, (u + 1) * episodes_per_update))
        episodes(t, seeds, deterministic=False, buffer=buf)
        job.upload(buf)  # one PPO update's batch (waits while the job holds untrained uploads)
        buf.clear()
    result = job.result(timeout=600)
    after = float(np.mean(episodes(t, test, deterministic=True)))
    return {"tenant": tenant, "before": before, "after": after, "updates": result["updates"],
            "dropped_stale": result["dropped_stale"], "version": result["version"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running service's gateway (default: start a local service)")
    p.add_argument("--token", help="the operator's or the tenant's token (none needed to create a tenant)")
    p.add_argument("--tenant", default="robot")
    p.add_argument("--updates", type=int, default=16)
    p.add_argument("--episodes", type=int, default=16)
    a = p.parse_args()
    with (Nexus(a.url, token=a.token) if a.url else Nexus.local("runs/examples")) as nx:
        out = run(nx, a.tenant, a.updates, a.episodes)
    print(json.dumps(out))
    print(f"mean return on 16 fixed goals: {out['before']:.2f} before -> {out['after']:.2f} after "
          f"{out['updates']} updates on uploaded episodes")


if __name__ == "__main__":
    main()
