"""Your own PPO loop (CleanRL style, in this process) on the service's simulators: ``tenant.vector_env`` is a
gymnasium VectorEnv of N envs in one environment session; the service only steps them (and meters the
simulator seconds to the tenant).

    python examples/ppo_service_envs.py                     # starts a local service (~1 min)
    python examples/ppo_service_envs.py --url http://127.0.0.1:PORT --iterations 2
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from torch import nn

from nexus.client.api import Nexus
from nexus.spec import TenantSpec

ENV = "maniskill/pushcube-state"


class Agent(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int) -> None:
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, act_dim))
        self.v = nn.Sequential(nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, 1))
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.5))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Normal:
        return torch.distributions.Normal(self.pi(obs), self.log_std.exp())


def run(nx: Nexus, tenant: str = "ppo-loop", iterations: int = 20, num_envs: int = 8, n_steps: int = 50,
        gamma: float = 0.8, lam: float = 0.9, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    t = nx.create_tenant(TenantSpec(name=tenant, env=ENV))
    history = []
    with t.vector_env(ENV, num_envs=num_envs, seed=seed) as envs:
        obs_dim, act_dim = envs.single_observation_space["state"].shape[0], envs.single_action_space.shape[0]
        agent = Agent(obs_dim, act_dim)
        opt = torch.optim.Adam(agent.parameters(), lr=3e-4)
        obs = torch.as_tensor(envs.reset(seed=seed)[0]["state"])
        for it in range(iterations):
            buf = {k: [] for k in ("obs", "act", "logp", "rew", "done", "val")}
            finished = []
            for _ in range(n_steps):  # collect: one HTTP call per vector step
                with torch.no_grad():
                    d, val = agent.dist(obs), agent.v(obs).squeeze(-1)
                    act = d.sample()
                nxt, rew, term, trunc, info = envs.step(act.numpy())
                for k, v in zip(buf, (obs, act, d.log_prob(act).sum(-1), torch.as_tensor(rew),
                                      torch.as_tensor(term | trunc, dtype=torch.float32), val), strict=True):
                    buf[k].append(v)
                finished += list(info["episode"]["r"][info["_episode"]]) if "episode" in info else []
                obs = torch.as_tensor(nxt["state"])  # same-step autoreset: already the next episode's start
            b = {k: torch.stack(v) for k, v in buf.items()}
            with torch.no_grad():  # GAE (an episode end cuts the bootstrap)
                next_v, adv, last = agent.v(obs).squeeze(-1), torch.zeros_like(b["rew"]), 0.0
                for s in reversed(range(n_steps)):
                    nv = next_v if s == n_steps - 1 else b["val"][s + 1]
                    delta = b["rew"][s] + gamma * nv * (1 - b["done"][s]) - b["val"][s]
                    adv[s] = last = delta + gamma * lam * (1 - b["done"][s]) * last
                ret = adv + b["val"]
            flat = {k: v.reshape(n_steps * num_envs, *v.shape[2:]) for k, v in {**b, "adv": adv, "ret": ret}.items()}
            for _ in range(4):  # PPO epochs of shuffled minibatches
                for mb in torch.randperm(len(flat["rew"])).split(100):
                    d = agent.dist(flat["obs"][mb])
                    ratio = (d.log_prob(flat["act"][mb]).sum(-1) - flat["logp"][mb]).exp()
                    a = (flat["adv"][mb] - flat["adv"][mb].mean()) / (flat["adv"][mb].std() + 1e-8)
                    pg = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a).mean()
                    v_loss = ((agent.v(flat["obs"][mb]).squeeze(-1) - flat["ret"][mb]) ** 2).mean()
                    opt.zero_grad()
                    (pg + 0.5 * v_loss).backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                    opt.step()
            history.append(float(np.mean(finished)) if finished else None)
            print(f"iteration {it}: {len(finished)} episodes, mean return {history[-1]}", flush=True)
    metered = nx.status(tenant=tenant)["tenants"][0].get("metered_s", {})
    return {"tenant": tenant, "returns": history, "env_steps": iterations * n_steps * num_envs,
            "simulator_s": metered.get("simulator")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running service's gateway (default: start a local service)")
    p.add_argument("--token")
    p.add_argument("--tenant", default="ppo-loop")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=50, help="vector steps per iteration")
    a = p.parse_args()
    with (Nexus(a.url, token=a.token) if a.url else Nexus.local("runs/examples")) as nx:
        print(json.dumps(run(nx, a.tenant, a.iterations, a.envs, a.steps)))


if __name__ == "__main__":
    main()
