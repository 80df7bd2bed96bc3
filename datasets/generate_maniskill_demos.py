"""Regenerate the ``pickcube-scripted`` SFT dataset: scripted PickCube-v1 demonstrations.

The expert acts in end-effector space (``pd_ee_delta_pos``: xyz delta + gripper, all in [-1, 1])
from the simulator's privileged state (cube, TCP and goal positions, grasp flag); it is a
stateless rule, so it needs no per-episode reset:

1. gripper open, move the TCP above the cube (hover height), then descend onto the cube centre;
2. close the gripper once the TCP is at the cube;
3. once grasped, carry the cube to the goal and hold still there (success needs a static robot).

Episodes are recorded through the Environment Service (``make_env`` + ``collect_episodes``, policy
version 0, logprob/value 0) into ``<out>/pickcube-scripted/episodes-000.arrow`` in the trajectory
store's schema. Failed episodes stay in the file, flagged by their ``success`` column (the
loader drops them for SFT by default); the manifest ``<out>/pickcube-scripted.toml`` records the
expert's success rate.

    python datasets/generate_maniskill_demos.py --episodes 40 --seed 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from nexus import catalog
from nexus.environment_service import PolicyOutput, collect_episodes, episode_stats, make_env
from nexus.features import Observation
from nexus.trajectory_store import columns_to_table, write_ipc

NAME = "pickcube-scripted"
ENV = "maniskill/pickcube-state"
FILE = "episodes-000.arrow"

# pd_ee_delta_pos maps an action of 1 to a 0.1 m target offset per control step
ACTION_SCALE = 0.1
GAIN = 1.5  # proportional gain on the position error, in units of the action scale
HOVER = 0.05  # approach height above the cube centre (m)
XY_TOL = 0.01  # align above the cube before descending
Z_TOL = 0.008  # close the gripper this close to the cube centre
OPEN, CLOSE = 1.0, -1.0


class PickCubeExpert:
    """Scripted pick-and-place on PickCube-v1 from the privileged simulator state."""

    def __init__(self, base_env: object) -> None:
        self.env = base_env

    def _state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        env = self.env
        cube = env.cube.pose.p[0].cpu().numpy()
        tcp = env.agent.tcp_pose.p[0].cpu().numpy()
        goal = env.goal_site.pose.p[0].cpu().numpy()
        grasped = bool(env.agent.is_grasping(env.cube)[0])
        return cube, tcp, goal, grasped

    def __call__(self, obs: Observation) -> PolicyOutput:
        cube, tcp, goal, grasped = self._state()
        if grasped:
            target, grip = goal, CLOSE
        elif np.linalg.norm(cube[:2] - tcp[:2]) > XY_TOL:
            # approach from above so the open fingers do not push the cube
            target, grip = cube + np.array([0.0, 0.0, HOVER]), OPEN
            if tcp[2] < cube[2] + HOVER / 2:
                target = np.array([tcp[0], tcp[1], cube[2] + HOVER])
        elif tcp[2] - cube[2] > Z_TOL:
            target, grip = cube, OPEN
        else:
            target, grip = cube, CLOSE
        delta = np.clip(GAIN * (target - tcp) / ACTION_SCALE, -1.0, 1.0)
        action = np.append(delta, grip).astype(np.float32)
        return PolicyOutput(action=action, logprob=0.0, value=0.0, version=0)


def write_manifest(path: Path, stats: dict[str, float], args: argparse.Namespace, instruction: str) -> None:
    path.write_text(
        "# Scripted end-effector expert on PickCube-v1 (state obs),\n"
        "# recorded through nexus.environment_service (make_env + collect_episodes).\n"
        "# Regenerate: python datasets/generate_maniskill_demos.py (see datasets/README.md).\n"
        f'name = "{NAME}"\n'
        'format = "arrow"\n'
        f'path = "{NAME}"\n'
        f'env = "{ENV}"\n'
        'generator = "datasets/generate_maniskill_demos.py"\n'
        "\n[schema]\n"
        "proprio_dim = 42\n"
        "action_dim = 4\n"
        f"instruction = {json.dumps(instruction)}\n"
        "\n# what the generator recorded (failed episodes are kept, flagged by the success column)\n"
        "[stats]\n"
        f"seed = {args.seed}\n"
        f"episodes = {int(stats['episodes'])}\n"
        f"steps = {int(stats['steps'])}\n"
        f"success_rate = {stats['success_rate']:.4f}\n"
        f"mean_return = {stats['mean_return']:.4f}\n"
    )


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--seed", type=int, default=0, help="episode i is reset with seed + i")
    p.add_argument("--out", type=Path, default=here, help="catalog datasets folder to write into")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    entry = catalog.env(ENV)
    t0 = time.time()
    env = make_env(entry, seed=args.seed)
    try:
        expert = PickCubeExpert(env.unwrapped)
        cols = collect_episodes(env, expert, args.episodes, seed=args.seed, tenant=NAME)
    finally:
        env.close()
    stats = episode_stats(cols)

    # one file in the trajectory store's schema; regeneration deliberately replaces the old file
    target = write_ipc(columns_to_table(cols, entry.schema, NAME), args.out / NAME / FILE, overwrite=True)
    write_manifest(args.out / f"{NAME}.toml", stats, args, entry.schema.instruction)

    print(f"expert success rate {stats['success_rate']:.1%} over {stats['episodes']} episodes "
          f"({stats['steps']} steps, mean return {stats['mean_return']:.2f}, mean length "
          f"{stats['mean_length']:.1f}) in {time.time() - t0:.0f} s")
    print(f"wrote {target} ({target.stat().st_size / 1024:.0f} KiB) and {args.out / (NAME + '.toml')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
