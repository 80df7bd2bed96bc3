"""RL is real: PPO with the OFT Gaussian head raises success on a ManiSkill task within a fixed CPU budget.

One process drives the service's own pieces directly (no Dask cluster): the Environment Service
(``make_env`` with ``num_envs`` sub-environments in their own processes, ``collect_episodes``), the
shared frozen backbone + the tenant's preprocessor and policy (``VLAFramework.group_act``: one grouped
backbone forward per vector step), the tenant's DeepSpeed slot and the actor's update function
(``nexus.actor.tasks.update_rl``: GAE + clipped PPO on a batch read back from the tenant's
Arrow trajectory store). Each update: ``--episodes`` fresh episodes of the current policy, then PPO.
Every ``--eval-every`` updates: deterministic episodes on held-out seeds (success rate = success at any
step of the episode, return). Episodes run their full length (``--terminate-on-success`` restores the
catalog's early end).

    python experiments/rl_learning/run.py ppo                       # PushCube, 15 min budget
    python experiments/rl_learning/run.py ppo --budget-min 30 --env maniskill/pickcube-state
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
EVAL_SEED = 1_000_000  # evaluation episodes never reuse a training seed


class Policy:
    """A collect_episodes policy backed by the framework: ``batch`` = one grouped backbone forward."""

    def __init__(self, framework, tenant: str, deterministic: bool, version: int = 0) -> None:
        self.framework, self.tenant, self.deterministic, self.version = framework, tenant, deterministic, version

    def batch(self, observations: list) -> list:
        from nexus.sim.environment import PolicyOutput

        outs = self.framework.group_act([(self.tenant, o) for o in observations], self.deterministic)
        return [PolicyOutput(action=o["raw_action"], logprob=o["logprob"], value=o["value"], version=self.version)
                for o in outs]

    def __call__(self, obs) -> object:
        return self.batch([obs])[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="maniskill/pushcube-state")
    ap.add_argument("--budget-min", type=float, default=15.0, help="wall-clock budget for training + evals")
    ap.add_argument("--num-envs", type=int, default=8, help="sub-environments (separate processes)")
    ap.add_argument("--episodes", type=int, default=16, help="episodes per PPO update")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-episodes", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gamma", type=float, default=0.8)
    ap.add_argument("--gae-lambda", type=float, default=0.9)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--minibatch", type=int, default=200)
    ap.add_argument("--target-kl", type=float, default=0.1, help="PPO early stop per update (CleanRL / ManiSkill)")
    ap.add_argument("--updates", type=int, default=0, help="stop after this many updates (0: the budget decides)")
    ap.add_argument("--init-log-std", type=float, default=-0.5, help="the Gaussian head's initial log std")
    ap.add_argument("--proprio-norm", choices=("tanh", "running"), default="tanh",
                    help="how the head reads the state (TenantSpec.proprio_norm)")
    ap.add_argument("--out", type=Path, default=HERE / "in_process.json",
                    help="JSON results file; this run is its section ppo_<task>")
    ap.add_argument("--terminate-on-success", action="store_true",
                    help="end episodes at success (the catalog default); off: fixed-length episodes, as ManiSkill's "
                         "PPO baseline trains — with termination and a dense reward, succeeding early forfeits the "
                         "remaining steps' reward, so PPO learns to hover next to the goal instead")
    args = ap.parse_args()

    import torch

    from nexus.actor.host import ActorHost
    from nexus.actor.tasks import update_rl
    from nexus.actor.tenant_slot import TenantSlot
    from nexus.config import catalog
    from nexus.config.service import ServiceConfig
    from nexus.data.trajectory_store import TrajectoryStore
    from nexus.model.preprocessor import TenantPreprocessor
    from nexus.sim.environment import collect_episodes, episode_stats, make_env
    from nexus.spec import PPOConfig, TenantSpec
    from nexus.wire.messages import RLWork

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t_start = time.time()
    budget_s = args.budget_min * 60
    work = Path(tempfile.mkdtemp(prefix="nexus-rl-"))
    svc = ActorHost(ServiceConfig(root=str(work)))  # tiny Qwen3-VL, 64 px
    entry = dataclasses.replace(catalog.env(args.env), terminate_on_success=args.terminate_on_success)
    name = "ppo"
    spec = TenantSpec(name=name, env=args.env, action_head="oft", lr=args.lr, grad_clip=0.5, seed=args.seed,
                      init_log_std=args.init_log_std, proprio_norm=args.proprio_norm)
    slot = svc.slots[name] = TenantSlot(spec, entry.schema, svc.feat_dim, grad_clip=spec.grad_clip)
    svc.framework.add_tenant(name, slot.policy, TenantPreprocessor(entry.schema, svc.backbone_cfg))
    store = TrajectoryStore(work / "trajectories", name, entry.schema)
    ppo = PPOConfig(gamma=args.gamma, gae_lambda=args.gae_lambda, update_epochs=args.epochs,
                    minibatch_size=args.minibatch, target_kl=args.target_kl)
    env = make_env(entry, seed=args.seed, num_envs=args.num_envs)
    print(f"{args.env}: {args.num_envs} sub-envs, backbone {svc.backbone_cfg.compat_key()}, "
          f"budget {args.budget_min:.0f} min ({time.time() - t_start:.0f} s setup)", flush=True)

    def evaluate() -> dict:
        cols = collect_episodes(env, Policy(svc.framework, name, True, slot.version), args.eval_episodes,
                                seed=EVAL_SEED, tenant=name)
        return episode_stats(cols)

    curve, evals, env_steps, update = [], [], 0, 0
    evals.append({"update": 0, "env_steps": 0, "time_s": time.time() - t_start, **evaluate()})
    print(f"eval   update {0:4d}  success {evals[-1]['success_rate']:.2f}  return {evals[-1]['mean_return']:.2f}",
          flush=True)
    while time.time() - t_start < budget_s and not (args.updates and update >= args.updates):
        slot.policy.eval()
        cols = collect_episodes(env, Policy(svc.framework, name, False, slot.version), args.episodes,
                                seed=args.seed * 7919, tenant=name, episode_offset=update * args.episodes)
        ref = store.append(cols)
        stats = update_rl(svc, slot, RLWork(ref, ppo))
        slot.bump_version()
        update += 1
        env_steps += len(cols["reward"])
        ep = episode_stats(cols)
        curve.append({"update": update, "env_steps": env_steps, "time_s": time.time() - t_start,
                      "train_return": ep["mean_return"], "train_success": ep["success_rate"],
                      **{k: stats[k] for k in ("pg_loss", "v_loss", "approx_kl", "clipfrac")}})
        print(f"update {update:4d}  steps {env_steps:7d}  return {ep['mean_return']:6.2f}  "
              f"success {ep['success_rate']:.2f}  kl {stats['approx_kl']:.4f}  ({time.time() - t_start:.0f} s)",
              flush=True)
        if update % args.eval_every == 0:
            evals.append({"update": update, "env_steps": env_steps, "time_s": time.time() - t_start, **evaluate()})
            print(f"eval   update {update:4d}  success {evals[-1]['success_rate']:.2f}  "
                  f"return {evals[-1]['mean_return']:.2f}", flush=True)
    if evals[-1]["update"] != update:
        evals.append({"update": update, "env_steps": env_steps, "time_s": time.time() - t_start, **evaluate()})
    env.close()

    first, last = evals[0], evals[-1]
    best = max(evals, key=lambda e: e["success_rate"])
    # single evaluations of a still-moving policy are noisy: also the mean of the last 3 and the sampled
    # policy's training episodes of the last 10 updates
    tail = {k: sum(e[k] for e in evals[-3:]) / len(evals[-3:]) for k in ("success_rate", "mean_return")}
    train_tail = {k: sum(c[f"train_{k}"] for c in curve[-10:]) / max(len(curve[-10:]), 1)
                  for k in ("success", "return")}
    print(f"\n{'':34s}{'success':>9s}{'return':>9s}")
    print(f"{'eval, start (update 0)':34s}{first['success_rate']:>9.2f}{first['mean_return']:>9.2f}")
    print(f"{f'eval, end (update {update})':34s}{last['success_rate']:>9.2f}{last['mean_return']:>9.2f}")
    print(f"{'eval, mean of the last 3':34s}{tail['success_rate']:>9.2f}{tail['mean_return']:>9.2f}")
    print(f"{'eval, best':34s}{best['success_rate']:>9.2f}{best['mean_return']:>9.2f}  (update {best['update']})")
    print(f"{'training episodes, first 10 updates':34s}"
          f"{sum(c['train_success'] for c in curve[:10]) / max(len(curve[:10]), 1):>9.2f}"
          f"{sum(c['train_return'] for c in curve[:10]) / max(len(curve[:10]), 1):>9.2f}")
    print(f"{'training episodes, last 10 updates':34s}{train_tail['success']:>9.2f}{train_tail['return']:>9.2f}")
    print(f"{env_steps} env steps, {update} PPO updates in {time.time() - t_start:.0f} s wall "
          f"({os.cpu_count()} cores, torch threads {torch.get_num_threads()})")

    slug = args.env.split("/")[-1]
    out = args.out
    plot_path = out.with_name(f"ppo_{slug}.png")
    plot(curve, evals, args.env, plot_path)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc[f"ppo_{slug}"] = {
        "meta": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                 "backbone": svc.backbone_cfg.compat_key(), "ppo": ppo.model_dump(),
                 "wall_s": round(time.time() - t_start, 1), "cpu_count": os.cpu_count(),
                 "python": platform.python_version(),
                 "torch": torch.__version__, "plot": plot_path.name, "out": str(out),
                 "command": "python experiments/rl_learning/run.py ppo " + " ".join(sys.argv[1:]),
                 "mode": "one process: model + environment service + actor update function (no cluster)"},
        "start": first, "end": last, "end_mean_last3": tail, "best": best, "train_last10": train_tail,
        "evals": evals, "train": curve}
    out.write_text(json.dumps(doc, indent=1, default=float))
    print(f"wrote {out} and {plot_path}")


def plot(curve: list[dict], evals: list[dict], env: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax in (a, b):
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
    steps = [c["env_steps"] for c in curve]
    a.plot(steps, [c["train_return"] for c in curve], lw=0.8, alpha=0.5, label="training episodes (sampled)")
    a.plot([e["env_steps"] for e in evals], [e["mean_return"] for e in evals], "o-", label="eval (deterministic)")
    a.set_xlabel("env steps")
    a.set_ylabel("episode return (normalized dense reward)")
    a.legend(fontsize=8)
    b.plot(steps, [c["train_success"] for c in curve], lw=0.8, alpha=0.5, label="training episodes (sampled)")
    b.plot([e["env_steps"] for e in evals], [e["success_rate"] for e in evals], "o-", label="eval (deterministic)")
    b.set_xlabel("env steps")
    b.set_ylabel("success rate")
    b.set_ylim(-0.02, 1.02)
    b.legend(fontsize=8)
    fig.suptitle(f"PPO, OFT Gaussian head on the shared backbone — {env} (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
