"""External rollouts (issue 22 item 2): a tenant's own environment or robot drives RL through the service.

The loop: ask the service's policy for actions (``tenant.predict_batch(observations)``: each output has the
``action`` to execute — the policy's sample, clip it to the env's bounds yourself —, its ``logprob``, the
critic's ``value`` and the policy ``version``), step the env, record each step in an :class:`EpisodeBuffer`
and, once episodes ended, upload them to an RL job submitted with ``rollouts="external"``
(``job.upload(buffer)`` / ``tenant.upload_episodes(job, buffer)``): each upload is one PPO update's batch,
stored first in the tenant's Arrow trajectory store. An upload whose oldest version lags the tenant's current
one by more than ``max_staleness`` is dropped, as the service's own rollouts are.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import numpy as np

from nexus.errors import SpecError
from nexus.features import Observation
from nexus.wire.inputs import decode_array


def _transport(tenant):
    return tenant.nexus.transport


def predict_batch(tenant, observations: list[Observation | dict[str, Any]], version: int | None = None,
                  deterministic: bool = False) -> list[dict[str, Any]]:
    """Actions for several observations in one request: per observation ``action`` (float32, unclipped),
    ``logprob``, ``value`` and ``version``."""
    t = _transport(tenant)
    out = t.request("POST", f"/v1/tenants/{quote(tenant.name, safe='')}/predict_batch", tenant=tenant.name,
                    json_body={"observations": list(observations), "version": version,
                               "deterministic": deterministic})
    return [{k: np.array(decode_array(v)) if isinstance(v, dict) else v for k, v in o.items()}
            for o in out["outputs"]]


class EpisodeBuffer:
    """Steps of whole episodes, in the order they happened, ready to upload.

    Several envs stepped together keep one buffer each (an upload takes episodes one after another), or
    call :meth:`add` only once an env's episode is complete (:meth:`extend`)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.episodes = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, obs: Observation | dict[str, Any], output: dict[str, Any], reward: float, terminated: bool,
            truncated: bool, success: bool = False) -> None:
        """One step: the observation the action was computed from, predict's output for it, what the env
        answered. A step with ``terminated`` or ``truncated`` ends the episode."""
        o = obs if isinstance(obs, Observation) else Observation(state=np.asarray(obs["state"], np.float32),
                                                                 images=dict(obs.get("images") or {}))
        self.rows.append({"state": np.asarray(o.state, np.float32), "images": o.images,
                          "action": np.asarray(output["action"], np.float32).reshape(-1),
                          "logprob": float(output["logprob"]), "value": float(output["value"]),
                          "policy_version": int(output["version"]), "reward": float(reward),
                          "terminated": bool(terminated), "truncated": bool(truncated), "success": bool(success)})
        self.episodes += bool(terminated or truncated)

    def extend(self, other: EpisodeBuffer) -> None:
        """Append another buffer's (complete) episodes."""
        if other.rows and not (other.rows[-1]["terminated"] or other.rows[-1]["truncated"]):
            raise SpecError("extend: the other buffer ends inside an episode")
        self.rows += other.rows
        self.episodes += other.episodes

    def columns(self) -> dict[str, Any]:
        """The upload's per-step columns (``nexus.wire.episodes``)."""
        if not self.rows:
            raise SpecError("no steps recorded")
        cols: dict[str, Any] = {k: np.stack([r[k] for r in self.rows]) for k in ("state", "action")}
        for k, dt in (("reward", np.float32), ("logprob", np.float32), ("value", np.float32),
                      ("policy_version", np.int64), ("terminated", np.int32), ("truncated", np.int32),
                      ("success", np.int32)):
            cols[k] = np.asarray([r[k] for r in self.rows], dt)
        cams = sorted(self.rows[0]["images"])
        if cams:
            cols["images"] = {c: np.stack([np.asarray(r["images"][c], np.uint8) for r in self.rows]) for c in cams}
        return cols

    def clear(self) -> None:
        self.rows, self.episodes = [], 0


def upload(tenant, job: str, episodes: EpisodeBuffer | dict[str, Any]) -> dict[str, Any]:
    """Upload whole episodes to the tenant's RL job ``job`` (``rollouts="external"``); waits while the job holds
    untrained uploads. Returns ``accepted``, ``rows``, ``episodes``, ``policy_version``, ``pending``."""
    cols = episodes.columns() if isinstance(episodes, EpisodeBuffer) else episodes
    return _transport(tenant).request("POST", f"/v1/jobs/{quote(job, safe='')}/episodes", tenant=tenant.name,
                                      json_body={"episodes": cols})
