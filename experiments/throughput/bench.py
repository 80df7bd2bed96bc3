"""One RL tenant through the service vs a plain single-process PyTorch loop: env-steps/s, side by side.

Both sides run the same task (ManiSkill3 PushCube, a 128 px rgb camera + robot state,
``maniskill/pushcube-rgb``), the same tiny Qwen3-VL weights (saved once to a local directory and loaded
from there by both), the same Gaussian OFT head (same spec and seed), the same PPO settings
(``nexus.algorithms.ppo``: GAE + clipped surrogate, same epochs / minibatch / lr / grad clip) and the
same work per update (E episodes with K envs stepped together, one batched backbone forward per step).

- plain: written here, one process: K envs, a batched forward per step, the pooled features kept for
  the update (as a careful hand-written loop would), then PPO with ``torch.optim.AdamW``; collection and
  update strictly one after the other.
- service: ``Nexus.local`` (scheduler + SIM workers + actor + inference engine, separate processes), one
  RL job of U updates with ``collectors`` rollout tasks in flight; producers step K envs and ask the
  engine for all their actions in one request; the update reads the rollout's cached features.

Rounds interleave the two (the order alternates), after one warm-up of each that is not counted; the
figure is the median over rounds of service / plain env-steps/s. Also the service's action round trip
split into engine compute, batching wait and messaging, and the engine's group-size distribution.

    python experiments/throughput/bench.py                     # CPU (~10 min on 2 loaded cores)
    python experiments/throughput/bench.py --device cuda       # GPU: bf16 backbone, ManiSkill GPU sim
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
ENV = "maniskill/pushcube-rgb"


def save_backbone(path: Path, image_size: int) -> None:
    """The tiny offline Qwen3-VL written as a checkpoint directory (model + tokenizer + image processor)."""
    from nexus.model.backbone import BackboneConfig, SharedBackbone

    bb = SharedBackbone(BackboneConfig(size="tiny", image_size=image_size))
    path.mkdir(parents=True, exist_ok=True)
    bb.family.model.save_pretrained(path)
    bb.processor.tokenizer.save_pretrained(path)
    bb.processor.image_processor.save_pretrained(path)


class PlainLoop:
    """The hand-written baseline: everything in this process, nothing overlapped."""

    def __init__(self, args, backbone_cfg, spec, ppo) -> None:
        import torch

        from nexus.config import catalog
        from nexus.model.backbone import SharedBackbone
        from nexus.model.preprocessor import TenantPreprocessor
        from nexus.sim.environment import LockstepEnvs, make_env

        self.args, self.spec, self.ppo = args, spec, ppo
        self.device = torch.device(args.device)
        self.entry = catalog.env(ENV)
        self.schema = self.entry.schema
        self.backbone = SharedBackbone(backbone_cfg)
        self.pre = TenantPreprocessor(self.schema, backbone_cfg)
        if args.device == "cuda":  # ManiSkill's batched GPU simulation
            self.env = make_env(self.entry, num_envs=args.envs, device="cuda")
        else:  # K envs in this process, stepped one after another (the service's producers do the same)
            self.env = LockstepEnvs([make_env(self.entry, num_envs=1, device="cpu") for _ in range(args.envs)])
        self.low, self.high = self.env.action_bounds

    def new_learner(self):
        import torch

        from nexus.model.policy import TenantPolicy

        policy = TenantPolicy.from_spec(self.spec, self.schema, self.backbone.hidden_size).to(self.device)
        opt = torch.optim.AdamW(policy.parameters(), lr=self.spec.lr, weight_decay=self.spec.weight_decay)
        return policy, opt

    def collect(self, policy, episodes: int, seed: int) -> tuple[dict, float, int]:
        """E whole episodes on K envs -> (batch arrays incl. pooled features, forward seconds, forwards)."""
        import numpy as np
        import torch

        from nexus.sim.environment import step_slots

        policy.eval()
        limit = self.entry.max_episode_steps
        pending = list(range(episodes))[::-1]
        slot_ep, obs, eps = {}, {}, {}
        forward_s, forwards = 0.0, 0
        t_collect = time.perf_counter()

        def start(slots):
            seeds = {}
            for s in slots:
                if pending:
                    i = pending.pop()
                    slot_ep[s], seeds[s] = i, seed + i
                    eps[i] = {k: [] for k in ("feature", "state", "action", "logprob", "value", "reward",
                                              "terminated", "truncated")}
            obs.update(self.env.reset_some(seeds) if seeds else {})

        start(list(range(self.env.num_envs)))
        while slot_ep:
            running = sorted(slot_ep)
            t0 = time.perf_counter()
            feats = self.pre.batch([obs[s] for s in running])
            pooled = self.backbone.encode(feats)
            proprio = torch.from_numpy(np.stack([f.proprio for f in feats])).to(self.device)
            action, logprob, value = policy.act(pooled, proprio)
            raw = action.float().cpu().numpy()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            forward_s += time.perf_counter() - t0
            forwards += 1
            results = step_slots(self.env, running, np.clip(raw, self.low, self.high))
            done = []
            pooled_np, lp, val = (x.float().cpu().numpy() for x in (pooled, logprob, value))
            for j, (s, r) in enumerate(zip(running, results, strict=True)):
                e = eps[slot_ep[s]]
                last = len(e["reward"]) == limit - 1
                for k, v in (("feature", pooled_np[j]), ("state", feats[j].proprio), ("action", raw[j]),
                             ("logprob", lp[j]), ("value", val[j]), ("reward", r.reward),
                             ("terminated", r.terminated), ("truncated", r.truncated or (last and not r.terminated))):
                    e[k].append(v)
                obs[s] = r.obs
                if r.terminated or r.truncated or last:
                    done.append(s)
                    del slot_ep[s]
            start(done)
        batch = {k: np.asarray([v for i in range(episodes) for v in eps[i][k]]) for k in eps[0]}
        self.sim_s += time.perf_counter() - t_collect - forward_s
        return batch, forward_s, forwards

    def update(self, policy, opt, batch: dict, version: int) -> None:
        """PPO with GAE over the batch, on the cached features (no backbone work here)."""
        import numpy as np
        import torch

        from nexus.algorithms.ppo import compute_gae, ppo_loss

        cfg = self.ppo
        term, trunc = batch["terminated"].astype(bool), batch["truncated"].astype(bool)
        dones = (term | trunc).astype(np.float32)
        boot = np.where(trunc & ~term, batch["value"], 0.0).astype(np.float32)
        adv, ret = compute_gae(batch["reward"].astype(np.float32), batch["value"].astype(np.float32), dones, 0.0,
                               cfg.gamma, cfg.gae_lambda, bootstrap_values=boot)
        dev = self.device
        feats = torch.from_numpy(batch["feature"].astype(np.float32)).to(dev)
        proprio = torch.from_numpy(batch["state"].astype(np.float32)).to(dev)
        actions = torch.from_numpy(batch["action"].astype(np.float32)).to(dev)
        old_lp = torch.from_numpy(batch["logprob"].astype(np.float32)).to(dev)
        adv, ret = torch.from_numpy(adv).to(dev), torch.from_numpy(ret).to(dev)
        n = len(actions)
        gen = torch.Generator().manual_seed(self.spec.seed + version)
        policy.train()
        for _ in range(cfg.update_epochs):
            perm = torch.randperm(n, generator=gen)
            for s in range(0, n, cfg.minibatch_size):
                mb = perm[s:s + cfg.minibatch_size].to(dev)
                loss, stats = ppo_loss(policy, feats[mb], proprio[mb], actions[mb], old_lp[mb], adv[mb], ret[mb], cfg)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), self.spec.grad_clip)
                opt.step()
            if cfg.target_kl is not None and stats["approx_kl"] > cfg.target_kl:
                break

    def run(self, updates: int, episodes: int, seed: int) -> dict:
        policy, opt = self.new_learner()
        self.sim_s = 0.0
        t0 = time.perf_counter()
        steps, forward_s, forwards = 0, 0.0, 0
        for u in range(updates):
            batch, f_s, f_n = self.collect(policy, episodes, seed + u * episodes)
            self.update(policy, opt, batch, u)
            steps += len(batch["reward"])
            forward_s, forwards = forward_s + f_s, forwards + f_n
        wall = time.perf_counter() - t0
        return {"env_steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
                "action_ms": 1e3 * forward_s / max(forwards, 1), "forwards": forwards, "sim_s": self.sim_s}

    def close(self) -> None:
        self.env.close()


def run_service_job(nx, name: str, spec_kw: dict, args, ppo) -> dict:
    from nexus.spec import TenantSpec

    t = nx.create_tenant(TenantSpec(name=name, env=ENV, **spec_kw))
    t0 = time.perf_counter()
    res = t.rl(updates=args.updates, episodes_per_batch=args.episodes, collectors=args.collectors,
               ppo=ppo.model_dump()).result(timeout=3600)
    wall = time.perf_counter() - t0
    n = max(res["timed"], 1)  # round trips the producers waited out (all of them with one wave)
    return {"env_steps": res["env_steps"], "wall_s": wall, "steps_per_s": res["env_steps"] / wall,
            "dropped_stale": res["dropped_stale"], "requests": res["requests"], "rows": res["rows"],
            "rtt_ms": 1e3 * res["rtt_s"] / n, "compute_ms": 1e3 * res["compute_s"] / n,
            "batching_wait_ms": 1e3 * res["engine_wait_s"] / n, "messaging_ms": 1e3 * res["messaging_s"] / n,
            "sim_s": res["sim_s"], "action_wait_s": res["action_wait_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds (each: one plain run + one service job)")
    ap.add_argument("--updates", type=int, default=3, help="PPO updates per run")
    ap.add_argument("--episodes", type=int, default=4, help="episodes per update (batch)")
    ap.add_argument("--envs", type=int, default=4, help="K: envs stepped together (plain loop and each producer)")
    ap.add_argument("--waves", type=int, default=1, help="service: producer waves (1: all K actions in one request)")
    ap.add_argument("--collectors", type=int, default=2, help="service: rollout tasks in flight")
    ap.add_argument("--n-sim", type=int, default=2, help="service: SIM workers")
    ap.add_argument("--max-wait-ms", type=float, default=5.0, help="service: inference wait T")
    ap.add_argument("--max-batch", type=int, default=8, help="service: target group size B (rows)")
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--multi", type=int, default=2,
                    help="then N tenants' RL jobs at once (same settings), for the cross-tenant group sizes (0: skip)")
    ap.add_argument("--out", default=None, help="JSON path (default: results_<device>.json here)")
    args = ap.parse_args()

    import torch

    from nexus.client.api import Nexus
    from nexus.model.backbone import BackboneConfig
    from nexus.spec import PPOConfig, TenantSpec

    torch.set_num_threads(1)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    work = Path(tempfile.mkdtemp(prefix="nexus-throughput-"))
    bb_dir = work / "qwen3vl-tiny"
    save_backbone(bb_dir, args.image_size)
    backbone = dict(family="qwen3vl", local_path=str(bb_dir), image_size=args.image_size, dtype=dtype,
                    device=args.device)
    spec_kw = dict(action_dim=4, seed=args.seed, hidden_dim=256, lr=3e-4, grad_clip=1.0)
    ppo = PPOConfig(update_epochs=4, minibatch_size=64)
    datapath = dict(envs_per_producer=args.envs, producer_waves=args.waves,
                    producer_vector_mode="async" if args.device == "cuda" else "lockstep")

    print(f"{ENV}: K={args.envs} envs, {args.episodes} episodes x {args.updates} updates per run, "
          f"backbone {bb_dir} ({args.image_size} px, {dtype}, {args.device}), {os.cpu_count()} cores", flush=True)
    plain = PlainLoop(args, BackboneConfig(**backbone), TenantSpec(name="plain", env=ENV, **spec_kw), ppo)
    rows = []
    with Nexus.local(work / "service", n_sim=args.n_sim, backbone=backbone, infer_max_wait_s=args.max_wait_ms / 1e3,
                     infer_max_batch=args.max_batch, datapath=datapath) as nx:
        t0 = time.time()
        from nexus.control.tasks import PREWARM

        sims = [w for w, info in nx.service.client.scheduler_info()["workers"].items() if "SIM" in info["resources"]]
        nx.service.client.gather([nx.service.client.submit(PREWARM, ENV, args.envs, args.waves,
                                           datapath["producer_vector_mode"], workers=[w], resources={"SIM": 1},
                                           pure=False) for w in sims])
        run_service_job(nx, "warm", spec_kw, args, ppo)  # every path warm
        engine = nx.service.engine()  # exists once a tenant does
        plain.run(1, args.episodes, 10_000)
        print(f"warm-up {time.time() - t0:.0f} s", flush=True)
        engine.reset_stats().result()
        for r in range(args.rounds):
            order = ("plain", "service") if r % 2 == 0 else ("service", "plain")
            got = {}
            for mode in order:
                if mode == "plain":
                    got[mode] = plain.run(args.updates, args.episodes, 1000 * (r + 1))
                else:
                    got[mode] = run_service_job(nx, f"svc-{r}", spec_kw, args, ppo)
            ratio = got["service"]["steps_per_s"] / got["plain"]["steps_per_s"]
            rows.append({"round": r, "order": list(order), "plain": got["plain"], "service": got["service"],
                         "ratio": ratio})
            print(f"round {r}: plain {got['plain']['steps_per_s']:.2f}  service "
                  f"{got['service']['steps_per_s']:.2f} env-steps/s  ratio {ratio:.3f}", flush=True)
        stats = engine.engine_stats().result()
        multi = None
        if args.multi > 0:
            from concurrent.futures import ThreadPoolExecutor

            engine.reset_stats().result()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.multi) as pool:
                outs = list(pool.map(lambda i: run_service_job(nx, f"multi-{i}", {**spec_kw, "seed": args.seed + i},
                                                               args, ppo), range(args.multi)))
            multi = {"tenants": args.multi, "wall_s": time.perf_counter() - t0, "jobs": outs,
                     "engine_stats": engine.engine_stats().result()}
    plain.close()

    ratios = [r["ratio"] for r in rows]
    med = {side: {k: statistics.median(r[side][k] for r in rows) for k in rows[0][side] if k != "order"}
           for side in ("plain", "service")}
    sizes = {int(k): v for k, v in stats["size_hist"].items()}
    mean_size = sum(k * v for k, v in sizes.items()) / max(sum(sizes.values()), 1)
    summary = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
               "target": 0.9, "median": med, "group_size_hist": sizes, "mean_group_rows": mean_size,
               "fire_reasons": stats["reasons"], "calls_per_group_hist": stats["calls_hist"]}

    print(f"\n{'':28s}{'plain loop':>14s}{'service':>14s}")
    print(f"{'env-steps/s (median)':28s}{med['plain']['steps_per_s']:>14.2f}{med['service']['steps_per_s']:>14.2f}")
    print(f"{'service / plain (median)':28s}{'':>14s}{summary['median_ratio']:>14.3f}"
          f"   (range {summary['min_ratio']:.3f}-{summary['max_ratio']:.3f}, {len(rows)} rounds, target >= 0.9)")
    print(f"{'action round trip, ms':28s}{med['plain']['action_ms']:>14.1f}{med['service']['rtt_ms']:>14.1f}")
    print(f"{'  engine compute':28s}{med['plain']['action_ms']:>14.1f}{med['service']['compute_ms']:>14.1f}")
    print(f"{'  batching wait':28s}{0.0:>14.1f}{med['service']['batching_wait_ms']:>14.1f}")
    print(f"{'  messaging':28s}{0.0:>14.1f}{med['service']['messaging_ms']:>14.1f}")
    per_request = med["service"]["rows"] / max(med["service"]["requests"], 1)
    print(f"{'simulator s per run':28s}{med['plain']['sim_s']:>14.1f}{med['service']['sim_s']:>14.1f}")
    print(f"{'rows per request':28s}{args.envs:>14d}{per_request:>14.2f}")
    print(f"group sizes (rows -> groups): {dict(sorted(sizes.items()))}, mean {mean_size:.2f}; "
          f"fired: {stats['reasons']}")
    if multi is not None:
        ms = multi["engine_stats"]
        msizes = {int(k): v for k, v in ms["size_hist"].items()}
        multi["mean_group_rows"] = sum(k * v for k, v in msizes.items()) / max(sum(msizes.values()), 1)
        mixed = sum(v for k, v in ms["tenants_hist"].items() if int(k) > 1) / max(ms["groups"], 1)
        multi["cross_tenant_share"] = mixed
        print(f"{args.multi} tenants at once: group sizes {dict(sorted(msizes.items()))}, mean "
              f"{multi['mean_group_rows']:.2f} rows; {100 * mixed:.0f} % of groups mix tenants; fired: {ms['reasons']}")

    out = Path(args.out) if args.out else HERE / f"results_{args.device}.json"
    out.write_text(json.dumps({
        "meta": {**vars(args), "env": ENV, "backbone": backbone, "ppo": ppo.model_dump(), "spec": spec_kw,
                 "datapath": datapath, "cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__, "load_avg_end": os.getloadavg(),
                 "command": "python experiments/throughput/bench.py " + " ".join(sys.argv[1:])},
        "summary": summary, "rounds": rows, "engine_stats": stats, "multi": multi}, indent=1, default=float))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
