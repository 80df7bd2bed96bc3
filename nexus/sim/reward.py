"""A tenant's reward in a service-hosted env: what the env exposes after each step, and the tenant's weighted sum.

The back-ends read the terms an env's catalog entry declares (:class:`~nexus.config.catalog.RewardSource`:
distances, contacts, grasps, the step's info values) besides the two every env has (``success``,
``env_reward``) into :attr:`StepResult.terms`. A tenant's ``reward`` (``nexus.spec.RewardTerm``) is data: a
term's name, a weight and one transform of a fixed set, evaluated here; nothing the tenant wrote is executed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from nexus.config.catalog import CatalogError, EnvEntry
from nexus.spec import REWARD_PREFIX

__all__ = ["REWARD_PREFIX", "TenantReward", "builtin_terms", "maniskill_terms", "robosuite_terms", "transformed"]


def builtin_terms(reward: float, success: bool) -> dict[str, float]:
    return {"env_reward": float(reward), "success": float(success)}


def _attr(root: Any, path: str, env: EnvEntry, term: str) -> Any:
    node = root
    for part in path.split("."):
        try:
            node = getattr(node, part)
        except AttributeError:
            raise CatalogError(f"env {env.name!r}: reward term {term!r}: the simulator has no {path!r}") from None
    return node


def _rows(x: Any) -> np.ndarray:
    """A (possibly batched, possibly torch) value as a float64 numpy array with a leading sub-env axis."""
    if hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x, np.float64)
    return a.reshape(1, -1) if a.ndim <= 1 else a.reshape(a.shape[0], -1)


def _distance(pa: np.ndarray, pb: np.ndarray, axes: str) -> np.ndarray:
    d = (pa - pb)[:, :2] if axes == "xy" else pa - pb
    return np.linalg.norm(d, axis=1)


def _declared(entry: EnvEntry, names: Collection[str] | None) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in entry.reward_terms.items() if names is None or k in names]


def maniskill_terms(env: EnvEntry, base: Any, info: Mapping[str, Any],
                    names: Collection[str] | None = None) -> list[dict[str, float]]:
    """The declared terms of a ManiSkill task after a step, one dict per sub-env (``base``: the unwrapped
    ``BaseEnv``; ``info``: its step info, batched or not; ``names``: only these, None: all). Objects are task
    attributes ("obj", "agent.tcp") with a pose (or a position tensor)."""
    cols: dict[str, np.ndarray] = {}
    for name, src in _declared(env, names):
        if src.kind == "info":
            if src.args[0] not in info:
                raise CatalogError(f"env {env.name!r}: reward term {name!r}: the step info has no "
                                   f"{src.args[0]!r} (it has {sorted(info)})")
            cols[name] = _rows(info[src.args[0]])[:, 0]
            continue
        objs = [_attr(base, a, env, name) for a in src.args]
        if src.kind == "distance":
            pa, pb = (_rows(o.pose.p if hasattr(o, "pose") else o) for o in objs)
            cols[name] = _distance(pa, pb, src.axes)
        elif src.kind == "contact":  # the contact force between the two, in newtons
            cols[name] = np.linalg.norm(_rows(base.scene.get_pairwise_contact_forces(*objs)), axis=1)
        else:  # grasp
            cols[name] = _rows(base.agent.is_grasping(objs[0]))[:, 0]
    n = max((len(v) for v in cols.values()), default=1)
    return [{k: float(v[i if len(v) > 1 else 0]) for k, v in cols.items()} for i in range(n)]


def _robosuite_model(env: Any, name: str, entry: EnvEntry, term: str) -> Any:
    return env.robots[0].gripper if name == "gripper" else _attr(env, name, entry, term)


def robosuite_terms(entry: EnvEntry, env: Any, raw: Mapping[str, Any], info: Mapping[str, Any],
                    names: Collection[str] | None = None) -> dict[str, float]:
    """The declared terms of a robosuite (or LIBERO) task after a step (``env``: the robosuite environment;
    ``raw``: its observation dict). Positions are observation keys ("cube_pos", "robot0_eef_pos"); contacts and
    grasps name models ("gripper": the robot's; else an attribute of the task, e.g. "cube"); ``names``: only
    these, None: all."""
    out: dict[str, float] = {}
    for name, src in _declared(entry, names):
        if src.kind == "info":
            if src.args[0] not in info:
                raise CatalogError(f"env {entry.name!r}: reward term {name!r}: the step info has no "
                                   f"{src.args[0]!r} (it has {sorted(info)})")
            out[name] = float(np.asarray(info[src.args[0]], np.float64).reshape(-1)[0])
        elif src.kind == "distance":
            missing = [a for a in src.args if a not in raw]
            if missing:
                raise CatalogError(f"env {entry.name!r}: reward term {name!r}: robosuite has no observation "
                                   f"{missing[0]!r}")
            pa, pb = (_rows(raw[a]) for a in src.args)
            out[name] = float(_distance(pa, pb, src.axes)[0])
        elif src.kind == "contact":
            a, b = (_robosuite_model(env, x, entry, name) for x in src.args)
            out[name] = float(bool(env.check_contact(a, b)))
        else:
            obj = _robosuite_model(env, src.args[0], entry, name)
            out[name] = float(bool(env._check_grasp(gripper=env.robots[0].gripper, object_geoms=obj)))
    return out


def transformed(transform: str, x: float, scale: float, threshold: float | None) -> float:
    """One term's value through its transform (nexus.spec.RewardTerm)."""
    if transform == "tanh":
        return 1.0 - float(np.tanh(scale * x))
    if transform == "exp":
        return float(np.exp(-scale * x))
    if transform == "below":
        return float(x < threshold)  # type: ignore[operator]
    return float(x)


class TenantReward:
    """A tenant's reward terms (``nexus.spec.RewardTerm``): per step, each term's weighted contribution."""

    def __init__(self, terms: Sequence[Any]) -> None:
        self.terms = tuple(terms)
        self.names = tuple(t.term for t in self.terms)

    def contributions(self, values: Mapping[str, float]) -> list[float]:
        """``weight * transform(value)`` of every term, in the spec's order; a term the step did not expose
        (a catalog entry changed under a running tenant) is an error naming it."""
        out = []
        for t in self.terms:
            if t.term not in values:
                raise CatalogError(f"reward term {t.term!r} was not exposed by the env's step (it exposed "
                                   f"{sorted(values)})")
            out.append(t.weight * transformed(t.transform, values[t.term], t.scale, t.threshold))
        return out

