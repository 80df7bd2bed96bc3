"""Regenerate the catalog's demonstration datasets: scripted experts recorded through the Environment Service.

Each expert is a stateless rule on the simulator's privileged state (object, end-effector and goal
positions, grasp flag); it acts in end-effector space (ManiSkill ``pd_ee_delta_pos``, robosuite
``OSC_POSE``), so it needs no motion planner (mplib segfaults with numpy 2 here, see DESIGN.md):

* ``pickcube-scripted`` — ManiSkill PickCube-v1 (state): hover above the cube, descend, grasp, carry
  to the goal and hold still.
* ``pushcube-scripted`` — ManiSkill PushCube-v1 (state): go behind the cube at table height, push it
  along +x into the target.
* ``robosuite-lift-scripted`` — robosuite Lift with the LIBERO schema (agent-view + wrist cameras,
  8-dim proprio): hover, descend, grasp, lift.

Episodes are recorded with ``make_env`` + ``collect_episodes`` (policy version 0, logprob/value 0) and
written in **both** formats: ``<name>/episodes-000.arrow`` (our trajectory schema) with its manifest
``<name>.toml``, and the LeRobot dataset ``<name>-lerobot/`` with ``<name>-lerobot.toml``. Failed
episodes stay in the files, flagged by their ``success`` column (SFT drops them by default); the
manifests record the expert's success rate.

    python datasets/generate_demos.py                    # all demos
    python datasets/generate_demos.py --demo pushcube --episodes 10 --out /tmp/demos
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nexus.config import catalog
from nexus.data.lerobot_format import write_lerobot
from nexus.data.trajectory_store import columns_to_table, write_ipc
from nexus.features import Observation, TenantSchema
from nexus.sim.environment import PolicyOutput, collect_episodes, episode_stats, make_env

FILE = "episodes-000.arrow"
OPEN, CLOSE = 1.0, -1.0  # ManiSkill gripper convention (robosuite's is the opposite)


def _delta(target: np.ndarray, tcp: np.ndarray, gain: float, scale: float) -> np.ndarray:
    """A proportional end-effector step toward ``target``, in action units clipped to [-1, 1]."""
    return np.clip(gain * (target - tcp) / scale, -1.0, 1.0)


def _p(x: Any) -> np.ndarray:
    """A ManiSkill pose position (batched torch) as numpy [3]."""
    return x.p[0].cpu().numpy()


class PickCubeExpert:
    """PickCube-v1: approach from above so the open fingers do not push the cube, grasp, carry."""

    SCALE, GAIN, HOVER, XY_TOL, Z_TOL = 0.1, 1.5, 0.05, 0.01, 0.008  # pd_ee_delta_pos: 1 = 0.1 m

    def __init__(self, env: Any) -> None:
        self.env = env.unwrapped

    def __call__(self, obs: Observation) -> PolicyOutput:
        env = self.env
        cube, tcp, goal = _p(env.cube.pose), _p(env.agent.tcp_pose), _p(env.goal_site.pose)
        if bool(env.agent.is_grasping(env.cube)[0]):
            target, grip = goal, CLOSE
        elif np.linalg.norm(cube[:2] - tcp[:2]) > self.XY_TOL:
            target, grip = cube + np.array([0.0, 0.0, self.HOVER]), OPEN
            if tcp[2] < cube[2] + self.HOVER / 2:
                target = np.array([tcp[0], tcp[1], cube[2] + self.HOVER])
        elif tcp[2] - cube[2] > self.Z_TOL:
            target, grip = cube, OPEN
        else:
            target, grip = cube, CLOSE
        action = np.append(_delta(target, tcp, self.GAIN, self.SCALE), grip).astype(np.float32)
        return PolicyOutput(action=action)


class PushCubeExpert:
    """PushCube-v1: the target lies in +x of the cube; get behind it (-x) at table height and push."""

    SCALE, GAIN, BEHIND, CLEAR, PUSH = 0.1, 1.5, 0.045, 0.08, 0.4

    def __init__(self, env: Any) -> None:
        self.env = env.unwrapped

    def __call__(self, obs: Observation) -> PolicyOutput:
        env = self.env
        cube, tcp, goal = _p(env.obj.pose), _p(env.agent.tcp.pose), _p(env.goal_region.pose)
        push_from = cube + np.array([-self.BEHIND, 0.0, 0.0])
        far = np.linalg.norm(tcp[:2] - push_from[:2]) > 0.015
        behind = tcp[0] < cube[0] - 0.03 and abs(tcp[1] - cube[1]) < 0.015 and tcp[2] < cube[2] + 0.045
        if behind:  # push slowly (a hit launches the cube) until the cube centre is on the goal
            target = np.array([goal[0] - self.BEHIND, cube[1], cube[2]])
            delta = np.clip(_delta(target, tcp, self.GAIN, self.SCALE), -self.PUSH, self.PUSH)
            return PolicyOutput(action=np.append(delta, CLOSE).astype(np.float32))
        elif far and tcp[2] < cube[2] + self.CLEAR - 0.03:  # rise clear of the cube first
            target = np.array([tcp[0], tcp[1], cube[2] + self.CLEAR])
        elif far:  # move over the push point at a safe height
            target = np.array([push_from[0], push_from[1], cube[2] + self.CLEAR])
        else:  # descend behind the cube
            target = push_from
        action = np.append(_delta(target, tcp, self.GAIN, self.SCALE), CLOSE).astype(np.float32)
        return PolicyOutput(action=action)


class RobosuiteLiftExpert:
    """robosuite Lift with OSC_POSE (1 = 5 cm per step, no rotation): hover, descend, grasp, lift."""

    SCALE, GAIN, HOVER, XY_TOL, Z_TOL, LIFT = 0.05, 1.0, 0.06, 0.006, 0.01, 0.15
    OPEN, CLOSE = -1.0, 1.0  # robosuite's gripper convention

    def __init__(self, env: Any) -> None:
        self.env = env.unwrapped
        self.closing = 0  # steps spent closing at the cube (fingers need a few steps)

    def __call__(self, obs: Observation) -> PolicyOutput:
        env = self.env
        cube = np.asarray(env.sim.data.body_xpos[env.cube_body_id])
        site = env.robots[0].eef_site_id  # robosuite 1.4: one id (1.5: per arm, {"right": id})
        tcp = np.asarray(env.sim.data.site_xpos[site["right"] if isinstance(site, dict) else site])
        grasped = bool(env._check_grasp(gripper=env.robots[0].gripper, object_geoms=env.cube))
        if tcp[2] - cube[2] > 0.03 and not grasped:
            self.closing = 0  # a new episode, or a lost cube
        if grasped and self.closing >= 4:
            target, grip = np.array([cube[0], cube[1], cube[2] + self.LIFT]), self.CLOSE
        elif np.linalg.norm(cube[:2] - tcp[:2]) > self.XY_TOL and self.closing == 0:
            target, grip = np.array([cube[0], cube[1], max(tcp[2], cube[2] + self.HOVER)]), self.OPEN
        elif tcp[2] - cube[2] > self.Z_TOL and self.closing == 0:
            target, grip = cube, self.OPEN
        else:
            target, grip = cube, self.CLOSE
            self.closing += 1
        action = np.concatenate([_delta(target, tcp, self.GAIN, self.SCALE), np.zeros(3), [grip]])
        return PolicyOutput(action=action.astype(np.float32))


@dataclass(frozen=True)
class Demo:
    name: str
    env: str
    expert: type
    episodes: int
    layout: str  # LeRobot layout of the copy
    summary: str


DEMOS = {
    "pickcube": Demo("pickcube-scripted", "maniskill/pickcube-state", PickCubeExpert, 40, "v3.0",
                     "Scripted end-effector expert on ManiSkill PickCube-v1 (state obs)"),
    "pushcube": Demo("pushcube-scripted", "maniskill/pushcube-state", PushCubeExpert, 40, "v2.1",
                     "Scripted end-effector expert on ManiSkill PushCube-v1 (state obs)"),
    "lift": Demo("robosuite-lift-scripted", "robosuite/lift-rgb", RobosuiteLiftExpert, 10, "v3.0",
                 "Scripted OSC expert on robosuite Lift, LIBERO schema (agent-view + wrist 64 px, 8-dim state)"),
}


def _schema_toml(schema: TenantSchema) -> str:
    cams = ", ".join(f'{{ name = "{c.name}", height = {c.height}, width = {c.width} }}' for c in schema.cameras)
    return (f"proprio_dim = {schema.proprio_dim}\naction_dim = {schema.action_dim}\n"
            f"instruction = {json.dumps(schema.instruction)}\n" + (f"cameras = [{cams}]\n" if cams else ""))


def write_manifest(path: Path, name: str, fmt: str, demo: Demo, schema: TenantSchema, stats: dict[str, float],
                   seed: int, extra: str = "") -> None:
    path.write_text(
        f"# {demo.summary},\n"
        f"# recorded through nexus.sim.environment (make_env + collect_episodes), {fmt} format.\n"
        "# Regenerate: python datasets/generate_demos.py (see datasets/README.md).\n"
        f'name = "{name}"\nformat = "{fmt}"\npath = "{name}"\nenv = "{demo.env}"\n'
        'generator = "datasets/generate_demos.py"\n'
        f"\n[schema]\n{_schema_toml(schema)}{extra}"
        "\n# what the generator recorded (failed episodes are kept, flagged by the success column)\n"
        f"[stats]\nseed = {seed}\nepisodes = {int(stats['episodes'])}\nsteps = {int(stats['steps'])}\n"
        f"success_rate = {stats['success_rate']:.4f}\nmean_return = {stats['mean_return']:.4f}\n")


def record(demo: Demo, episodes: int, seed: int, out: Path) -> dict[str, Any]:
    """Run the expert, write both formats and their manifests; returns the episode statistics."""
    entry = catalog.env(demo.env)
    t0 = time.time()
    env = make_env(entry, seed=seed, device="cpu")
    try:
        cols = collect_episodes(env, demo.expert(env), episodes, seed=seed, tenant=demo.name)
    finally:
        env.close()
    stats = episode_stats(cols)
    # regeneration deliberately replaces the old files
    # camera datasets are zstd-compressed (~5x smaller, still read by the same code, not zero-copy)
    arrow = write_ipc(columns_to_table(cols, entry.schema, demo.name), out / demo.name / FILE, overwrite=True,
                      compression="zstd" if entry.schema.cameras else None)
    write_manifest(out / f"{demo.name}.toml", demo.name, "arrow", demo, entry.schema, stats, seed)
    lr_name = f"{demo.name}-lerobot"
    fps = int(entry.options.get("control_freq", 20))  # both simulators' tasks here step at 20 Hz
    write_lerobot(out / lr_name, cols, entry.schema, fps=fps, layout=demo.layout, robot_type="panda",
                  overwrite=True)
    write_manifest(out / f"{lr_name}.toml", lr_name, "lerobot", demo, entry.schema, stats, seed,
                   extra=f"\n# LeRobot layout {demo.layout}, {fps} fps; features use the default names\n")
    size = sum(f.stat().st_size for f in (out / lr_name).rglob("*") if f.is_file())
    return stats | {"name": demo.name, "env": demo.env, "seconds": time.time() - t0,
                    "arrow_kib": arrow.stat().st_size / 1024, "lerobot_kib": size / 1024}


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="append", choices=sorted(DEMOS), help="which demos (default: all)")
    p.add_argument("--episodes", type=int, default=None, help="episodes per demo (default: each demo's own)")
    p.add_argument("--seed", type=int, default=0, help="episode i is reset with seed + i")
    p.add_argument("--out", type=Path, default=here, help="catalog datasets folder to write into")
    p.add_argument("--json", type=Path, default=None, help="also write the statistics here")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    results = []
    for key in args.demo or list(DEMOS):
        demo = DEMOS[key]
        r = record(demo, args.episodes or demo.episodes, args.seed, args.out)
        results.append(r)
        print(f"{r['name']:<26} ({r['env']}): expert success rate {r['success_rate']:.1%} over {r['episodes']} "
              f"episodes ({r['steps']} steps, mean length {r['mean_length']:.1f}, mean return "
              f"{r['mean_return']:.2f}) in {r['seconds']:.0f} s; arrow {r['arrow_kib']:.0f} KiB, "
              f"lerobot {demo.layout} {r['lerobot_kib']:.0f} KiB", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
