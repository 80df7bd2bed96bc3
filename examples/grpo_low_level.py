"""GRPO composed from the low-level calls: groups of episodes from the same start (a vector env of the
service's simulators, every env reset with one seed), actions sampled from the tenant's policy with their
log-probabilities (``predict_batch``), each episode's return standardized within its group as the advantage of
all its steps, then ``forward_backward(..., loss="grpo")``, ``optim_step()`` and ``save_weights()``.

    python examples/grpo_low_level.py                       # starts a local service (~1 min)
    python examples/grpo_low_level.py --url http://127.0.0.1:PORT --iterations 1
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from nexus.algorithms.grpo import group_advantages
from nexus.client.api import Nexus
from nexus.client.envs import unbatch
from nexus.spec import TenantSpec

ENV = "maniskill/pushcube-state"


def run(nx: Nexus, tenant: str = "grpo", iterations: int = 5, group: int = 4, max_steps: int = 50) -> dict:
    t = nx.create_tenant(TenantSpec(name=tenant, env=ENV, lr=5e-4))
    history = []
    with t.vector_env(ENV, num_envs=group) as envs:
        for it in range(iterations):
            obs = envs.reset(seed=[1000 + it] * group)[0]  # one start for the whole group
            steps, returns, alive = [], np.zeros(group), np.ones(group, bool)
            for _ in range(max_steps):
                rows = unbatch(obs)  # one observation per env, each as predict takes it
                outs = t.predict_batch(rows).result()
                actions = np.stack([o["action"] for o in outs])
                nxt, rew, term, trunc, _ = envs.step(np.clip(actions, -1.0, 1.0))
                for i in np.flatnonzero(alive):
                    steps.append((i, rows[i], actions[i], outs[i]["logprob"]))
                returns += rew * alive
                alive &= ~(term | trunc)  # an ended env keeps stepping (autoreset) but no longer counts
                obs = nxt
                if not alive.any():
                    break
            adv = group_advantages(returns, np.zeros(group))  # one group: standardized returns
            rows = [s[0] for s in steps]
            logprobs = np.asarray([s[3] for s in steps], np.float32)
            batch = {"observations": [s[1] for s in steps], "actions": np.stack([s[2] for s in steps]),
                     "logprobs": logprobs, "advantages": adv[rows], "ref_logprobs": logprobs,
                     "grpo": {"clip_coef": 0.2, "kl_coef": 0.01}}
            metrics = t.forward_backward(batch, loss="grpo").result()["metrics"]
            t.optim_step().result()
            version = t.save_weights().result()
            history.append({"version": version, "mean_return": float(returns.mean()),
                            "loss": float(metrics.get("loss", float("nan")))})
            print(f"iteration {it}: group returns {np.round(returns, 2).tolist()} -> v{version}", flush=True)
    return {"tenant": tenant, "history": history}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running service's gateway (default: start a local service)")
    p.add_argument("--token")
    p.add_argument("--tenant", default="grpo")
    p.add_argument("--iterations", type=int, default=5)
    a = p.parse_args()
    with (Nexus(a.url, token=a.token) if a.url else Nexus.local("runs/examples")) as nx:
        print(json.dumps(run(nx, a.tenant, a.iterations)))


if __name__ == "__main__":
    main()
