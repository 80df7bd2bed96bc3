"""Heterogeneous tenant schemas and schema-faithful synthetic samples for them.

LIBERO and CALVIN data cannot be had offline here (LIBERO's assets download at run time, CALVIN's
dataset is a multi-GB download), so tests and experiments use their **schemas** with generated
samples: the same cameras (names, sizes), proprio and action dimensions as the real suites, with
images and proprio drawn from a small latent scene and actions from a simple reaching controller, so
there is something to learn. They are stand-ins for throughput and equivalence measurements, not for
task success. The ManiSkill schemas are the catalog's own (``envs/maniskill.toml``).

- LIBERO-like: agent-view + wrist cameras (128 x 128, LIBERO's render size), 8-dim proprio
  (end-effector position 3, axis-angle 3, gripper joints 2), 7-dim actions (delta pose 6, gripper 1).
- CALVIN-like: static camera 200 x 200 + gripper camera 84 x 84, 15-dim proprio (``robot_obs``: TCP
  position 3, TCP orientation 3, gripper width 1, arm joints 7, gripper action 1), 7-dim relative actions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nexus.config import catalog
from nexus.features import CameraSpec, Observation, TenantSchema

LIBERO_INSTRUCTIONS = (
    "open the middle drawer of the cabinet", "put the bowl on the plate", "push the plate to the front of the stove",
    "put the wine bottle on top of the cabinet", "turn on the stove", "put the cream cheese in the bowl",
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
)
CALVIN_INSTRUCTIONS = (
    "open the drawer", "push the sliding door to the left", "lift the red block from the table",
    "turn on the light bulb", "rotate the blue block to the right", "push the pink block to the left",
    "place the block in the sliding cabinet",
)

LIBERO_LIKE = TenantSchema(proprio_dim=8, action_dim=7, instruction=LIBERO_INSTRUCTIONS[1],
                           cameras=(CameraSpec("agentview", 128, 128), CameraSpec("wrist", 128, 128)))
CALVIN_LIKE = TenantSchema(proprio_dim=15, action_dim=7, instruction=CALVIN_INSTRUCTIONS[0],
                           cameras=(CameraSpec("rgb_static", 200, 200), CameraSpec("rgb_gripper", 84, 84)))

_INSTRUCTIONS = {LIBERO_LIKE: LIBERO_INSTRUCTIONS, CALVIN_LIKE: CALVIN_INSTRUCTIONS}


def maniskill_schema(task: str) -> TenantSchema:
    """A catalog ManiSkill schema, e.g. ``"pickcube-rgb"`` (29-dim state + one 64 px camera, 4-dim actions)."""

    return catalog.env(f"maniskill/{task}").schema


def tenant_schemas() -> dict[str, TenantSchema]:
    """The heterogeneous mix the experiments cycle through (every schema has cameras)."""
    return {"libero": LIBERO_LIKE, "calvin": CALVIN_LIKE, "maniskill-pickcube-rgb": maniskill_schema("pickcube-rgb")}


@dataclass
class SyntheticTenant:
    """Deterministic samples of one schema: ``batch(n, seed)`` -> (observations, action chunks).

    A latent scene per sample: object position, end-effector position, gripper state. Cameras render
    the object (a coloured square) and the end effector (a dot); wrist / gripper cameras see a zoomed
    window around the end effector. The action chunk is a reaching controller rolled forward
    ``chunk`` steps: delta position towards the object, small rotation deltas, gripper closes near it.
    """

    schema: TenantSchema
    chunk: int = 1
    instructions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.instructions:
            self.instructions = _INSTRUCTIONS.get(self.schema, (self.schema.instruction or "do the task",))

    def batch(self, n: int, seed: int | tuple[int, ...]) -> tuple[list[Observation], np.ndarray]:
        rng = np.random.default_rng(seed)
        obs, actions = [], []
        for _ in range(n):
            o, a = self._sample(rng)
            obs.append(o)
            actions.append(a)
        return obs, np.stack(actions).astype(np.float32)

    def _sample(self, rng: np.random.Generator) -> tuple[Observation, np.ndarray]:
        target = rng.uniform(-0.8, 0.8, 3)
        eef = rng.uniform(-1.0, 1.0, 3)
        colour = rng.integers(60, 255, 3)
        images = {c.name: self._render(c, i, target, eef, colour, rng)
                  for i, c in enumerate(self.schema.cameras)}
        instruction = self.instructions[int(rng.integers(len(self.instructions)))]
        chunk, pos = [], eef.copy()
        for _ in range(self.chunk):
            action, delta = self._action(pos, target, rng)
            chunk.append(action)
            pos = pos + 0.1 * delta  # roll the scene forward: the next step of the chunk
        return Observation(state=self._proprio(eef, target, rng), images=images, instruction=instruction), \
            np.concatenate(chunk)

    def _proprio(self, eef: np.ndarray, target: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        p = self.schema.proprio_dim
        # eef position first, then smooth functions of it (orientation / joints / gripper), then noise
        feats = np.concatenate([eef, np.sin(2 * eef), np.cos(3 * eef), np.tanh(eef[:1] - eef[1:2]),
                                np.sin(eef[:1] + eef[2:3]), rng.normal(0, 0.05, max(0, p - 11))])
        return feats[:p].astype(np.float32)

    def _action(self, eef: np.ndarray, target: np.ndarray,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """-> (action [A]: delta position, rotation deltas, gripper last; the delta position actually used)."""
        a = self.schema.action_dim
        delta = np.clip(3.0 * (target - eef), -1, 1)
        gripper = 1.0 if np.linalg.norm(target - eef) < 0.3 else -1.0
        k = min(3, a - 1)
        delta[k:] = 0.0
        middle = rng.normal(0, 0.05, max(0, a - 1 - k))  # rotation deltas: small noise
        return np.concatenate([delta[:k], middle, [gripper]]).astype(np.float32), delta

    @staticmethod
    def _render(cam: CameraSpec, index: int, target: np.ndarray, eef: np.ndarray, colour: np.ndarray,
                rng: np.random.Generator) -> np.ndarray:
        h, w = cam.height, cam.width
        img = np.empty((h, w, 3), np.uint8)
        img[:] = (90 + 40 * index, 80, 70)  # table colour differs per camera
        img += rng.integers(0, 12, (h, w, 1), dtype=np.uint8)  # sensor noise
        zoom = 1.0 if index == 0 else 2.5  # second camera: a wrist / gripper view around the end effector
        centre = np.zeros(2) if index == 0 else eef[:2]

        def px(p: np.ndarray) -> tuple[int, int]:
            u = (p[:2] - centre) * zoom
            return int((u[1] + 1) / 2 * (h - 1)), int((u[0] + 1) / 2 * (w - 1))

        r, c = px(target)
        s = max(2, int(0.08 * min(h, w) * zoom))
        img[max(r - s, 0):max(min(r + s, h), 0), max(c - s, 0):max(min(c + s, w), 0)] = colour
        r, c = px(eef)
        d = max(1, min(h, w) // 32)
        img[max(r - d, 0):max(min(r + d, h), 0), max(c - d, 0):max(min(c + d, w), 0)] = (255, 255, 255)
        return img
