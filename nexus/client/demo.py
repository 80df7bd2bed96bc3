"""The main demo: four tenants share one service at the same time.

* ``push-rl``  — RL (PPO) on ManiSkill PushCube, state observations
* ``pick-rgb`` — RL (PPO) on ManiSkill PickCube with an rgb camera
* ``pick-sft`` — SFT on recorded scripted PickCube demonstrations (``datasets/pickcube-scripted``)
* an evaluation of ``pick-sft`` that pins the version current at its start while SFT goes on
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from nexus.client.api import Job, Nexus
from nexus.spec import TenantSpec

TENANTS = [
    TenantSpec(name="push-rl", env="maniskill/pushcube-state", action_dim=4, lr=3e-4, max_inflight=2, seed=1),
    TenantSpec(name="pick-rgb", env="maniskill/pickcube-rgb", action_dim=4, lr=3e-4, max_inflight=2, seed=2),
    TenantSpec(name="pick-sft", dataset="pickcube-scripted", env="maniskill/pickcube-state", action_dim=4,
               lr=1e-3, max_inflight=2, seed=3),
]


def _fmt(x: Any, nd: int = 3) -> str:
    return f"{x:.{nd}f}" if isinstance(x, float) else ("-" if x is None else str(x))


def job_row(info: dict[str, Any]) -> list[str]:
    p = {**info["progress"], **(info["result"] or {})}
    steps = p.get("episodes") if info["kind"] == "eval" else p.get("steps", p.get("updates"))
    metric = {"sft": ("loss", p.get("loss")), "rl": ("return", p.get("return")),
              "eval": ("success", p.get("success_rate"))}[info["kind"]]
    extra = (f"held-out mse {_fmt(p.get('heldout_action_mse'))}" if info["kind"] == "sft" else
             f"success {_fmt(p.get('success_rate'))}" if info["kind"] == "rl" else
             f"episodes {p.get('episodes', '-')}, versions seen {p.get('versions_seen', '-')}")
    return [info["tenant"], info["kind"], info["job"], info["state"], _fmt(steps), _fmt(p.get("version")),
            f"{metric[0]} {_fmt(metric[1])}", extra, _fmt(p.get("dropped_stale", 0 if info["kind"] == "rl" else "-"))]


def table(infos: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("tenant", "job", "id", "state", "steps", "version", "loss / return / success", "more",
                "dropped stale"):
        t.add_column(col)
    for info in infos:
        t.add_row(*job_row(info))
    return t


def metering_table(status: dict[str, Any]) -> Table:
    """Device-seconds charged to each tenant per service, and each service's measured busy time."""
    t = Table(title="Metering: device-seconds per tenant")
    for col in ("tenant", "actor s", "inference s", "simulator s"):
        t.add_column(col, justify="right" if col != "tenant" else "left")
    for x in status["tenants"]:
        m = x["metered_s"]
        t.add_row(x["tenant"], f"{m['actor']:.2f}", f"{m['inference']:.2f}", f"{m['simulator']:.2f}")
    busy = status["busy_s"]
    t.add_row("[b]measured busy[/b]", *(f"{busy.get(s, 0.0):.2f}" for s in ("actor", "inference", "simulator")))
    return t


def run_demo(root: str = "runs/demo", rl_updates: int = 24, sft_steps: int = 300, eval_episodes: int = 8) -> list[dict]:
    console = Console() if Console().is_terminal else Console(width=150)
    t0 = time.time()
    console.print(f"[bold]JoyNexus demo[/] — starting a local Dask cluster in {Path(root).resolve()} …")
    with Nexus.local(root) as nx:
        console.print(f"Dask dashboard: [link]{nx.dashboard_link}[/link]  (Nexus page: /nexus/api/state)")
        tenants = {s.name: nx.create_tenant(s) for s in TENANTS}
        console.print(f"tenants created: {', '.join(tenants)} ({time.time() - t0:.0f} s)")
        jobs: list[Job] = [
            tenants["push-rl"].rl(updates=rl_updates, episodes_per_batch=2, collectors=2),
            tenants["pick-rgb"].rl(updates=max(2, rl_updates // 4), episodes_per_batch=1, collectors=1),
            tenants["pick-sft"].sft(steps=sft_steps, batch_size=64),
            tenants["pick-sft"].evaluate(episodes=eval_episodes),
        ]
        with Live(console=console, refresh_per_second=2) as live:
            while True:
                infos = [j.info() for j in jobs]
                live.update(table(infos, f"running … {time.time() - t0:.0f} s"))
                if all(i["state"] in ("done", "failed") for i in infos):
                    break
                time.sleep(1.0)
        # the SFT policy at its final version, for comparison with the version pinned at the start
        final = tenants["pick-sft"].evaluate(episodes=eval_episodes)
        final.result(timeout=600)
        infos.append(final.info())
        nx.flush()
        console.print(table(infos, f"JoyNexus demo — finished in {time.time() - t0:.0f} s"))
        st = nx.status()
        console.print(metering_table(st))
        cfg = st["config"]
        console.print(f"Dask dashboard: {nx.dashboard_link} (live while the service runs)")
        uri = cfg["tracking_uri"] or f"sqlite:///{Path(cfg['root']) / 'mlflow.db'}"
        console.print(f"MLflow store: {uri}  →  mlflow ui --backend-store-uri {uri}")
        console.print(f"tenant output dirs: {Path(cfg['root']) / 'tenants'}")
        failed = [i for i in infos if i["state"] != "done"]
        for i in failed:
            console.print(f"[red]job {i['job']} failed: {i['error']}[/]")
        return infos
