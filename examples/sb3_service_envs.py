"""Stable-Baselines3 on the service: SB3's PPO trains on a ``ServiceVectorEnv`` (through the thin
``SB3VecEnv`` adapter), and a policy exported from the service acts where SB3 expects
``predict(obs) -> (action, state)`` (``evaluate_policy``). Needs the optional extra: ``pip install -e '.[sb3]'``.

    python examples/sb3_service_envs.py                      # starts a local service (~1 min)
    python examples/sb3_service_envs.py --url http://127.0.0.1:PORT --timesteps 256
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from stable_baselines3 import PPO
from stable_baselines3.common.evaluation import evaluate_policy

import nexus.export.policy
from nexus.client.api import Nexus
from nexus.client.sb3 import SB3VecEnv
from nexus.spec import TenantSpec

ENV = "maniskill/pushcube-state"


def run(nx: Nexus, tenant: str = "sb3", timesteps: int = 4096, num_envs: int = 8, eval_episodes: int = 4,
        export: bool = True) -> dict:
    t = nx.create_tenant(TenantSpec(name=tenant, env=ENV))
    # 1. SB3's PPO, its policy in this process, the simulators on the service
    with SB3VecEnv(t.vector_env(ENV, num_envs=num_envs, seed=0)) as venv:
        model = PPO("MultiInputPolicy", venv, n_steps=64, batch_size=128, n_epochs=4, seed=0, device="cpu")
        model.learn(total_timesteps=timesteps)
        sb3_mean, _ = evaluate_policy(model, venv, n_eval_episodes=eval_episodes)
    out = {"tenant": tenant, "timesteps": int(model.num_timesteps), "sb3_mean_return": float(sb3_mean)}
    if not export:
        return out
    # 2. the tenant's own service-trained policy, exported, acting through SB3's predict interface
    with tempfile.TemporaryDirectory() as tmp:
        t.export(None, Path(tmp) / "policy")
        policy = nexus.export.policy.load(Path(tmp) / "policy")
        with SB3VecEnv(t.vector_env(ENV, num_envs=2, seed=100)) as venv:
            exported_mean, _ = evaluate_policy(policy, venv, n_eval_episodes=eval_episodes)
    return {**out, "exported_policy_version": policy.version, "exported_mean_return": float(exported_mean)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running service's gateway (default: start a local service)")
    p.add_argument("--token")
    p.add_argument("--tenant", default="sb3")
    p.add_argument("--timesteps", type=int, default=4096)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--eval-episodes", type=int, default=4)
    p.add_argument("--no-export", action="store_true", help="skip part 2 (the exported policy)")
    a = p.parse_args()
    with (Nexus(a.url, token=a.token) if a.url else Nexus.local("runs/examples")) as nx:
        print(json.dumps(run(nx, a.tenant, a.timesteps, a.envs, a.eval_episodes, not a.no_export)))


if __name__ == "__main__":
    main()
