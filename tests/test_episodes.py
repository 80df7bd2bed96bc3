"""Uploaded episodes (external rollouts) checked where they enter: numbering, refusals, the wait for a version
the control plane is recording (no cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from nexus.errors import LimitExceeded, SpecError
from nexus.features import CameraSpec, TenantSchema
from nexus.gateway import envs
from nexus.gateway.envs import recorded_view
from nexus.wire.episodes import check_episodes, newest_version

SCHEMA = TenantSchema(proprio_dim=2, action_dim=1)


def upload(n: int = 5, ends: tuple[int, ...] = (1, 4)) -> dict:
    done = [i in ends for i in range(n)]
    return {"state": np.zeros((n, 2), np.float32).tolist(), "action": [[0.1]] * n, "reward": [1.0] * n,
            "logprob": [-0.5] * n, "value": [0.0] * n, "terminated": [False] * n, "truncated": done,
            "policy_version": [3] * n}


def test_episodes_and_steps_are_numbered_from_the_episode_ends():
    cols = check_episodes(upload(), SCHEMA, current_version=3, max_rows=100, max_episodes=10)
    assert cols["episode"].tolist() == [0, 0, 1, 1, 1]
    assert cols["step"].tolist() == [0, 1, 0, 1, 2]
    assert cols["success"].tolist() == [False] * 5 and cols["policy_version"].dtype == np.int64


@pytest.mark.parametrize("change, error, match", [
    ({"policy_version": [4] * 5}, SpecError, "versions so far are 0..3"),
    ({"truncated": [False] * 5}, SpecError, "ends no episode"),
    ({"reward": [1.0, 2.0]}, SpecError, r"episodes.reward: shape \(2,\)"),
    ({"truncated": [0, 2, 0, 0, 1]}, SpecError, "booleans expected"),
    ({"action": [[np.inf]] * 5}, SpecError, "NaN or infinite"),
    ({"images": {"cam": np.zeros((5, 8, 8, 3), np.uint8)}}, SpecError, "cameras"),
    ({"episode": [0] * 5}, SpecError, "unknown field"),
])
def test_bad_uploads_are_refused_with_the_field(change, error, match):
    with pytest.raises(error, match=match):
        check_episodes({**upload(), **change}, SCHEMA, current_version=3, max_rows=100, max_episodes=10)


def test_limits_and_cameras():
    with pytest.raises(LimitExceeded, match="max_batch_rows=4"):
        check_episodes(upload(), SCHEMA, 3, max_rows=4, max_episodes=10)
    with pytest.raises(LimitExceeded, match="max_episodes_per_batch=1"):
        check_episodes(upload(), SCHEMA, 3, max_rows=100, max_episodes=1)
    cam = TenantSchema(proprio_dim=2, action_dim=1, cameras=(CameraSpec("wrist", 8, 8),))
    cols = check_episodes({**upload(), "images": {"wrist": np.ones((5, 8, 8, 3), np.uint8)}}, cam, 3, 100, 10)
    assert cols["image.wrist"].shape == (5, 8, 8, 3)


class RecordsLater:
    """The control plane's view of a tenant whose version ``recorded`` is recorded only at the ``after``-th read
    (the moment between the actor's push to the engines and its update's result reaching the control plane)."""

    def __init__(self, before: int, recorded: int, after: int) -> None:
        self.before, self.recorded, self.after, self.reads = before, recorded, after, 0

    async def tenant_view(self, tenant: str) -> dict:
        self.reads += 1
        return {"name": tenant, "version": self.recorded if self.reads >= self.after else self.before}


def test_newest_version_reads_an_upload_or_leaves_the_error_to_the_check():
    assert newest_version({**upload(), "policy_version": [1, 2, 4, 3, 0]}) == 4
    assert newest_version({**upload(), "policy_version": [0.5] * 5}) is None
    assert newest_version({"state": []}) is None and newest_version([1, 2]) is None


def test_an_upload_waits_for_the_control_plane_to_record_the_version_predict_answered(monkeypatch):
    view = RecordsLater(before=1, recorded=2, after=4)
    assert asyncio.run(recorded_view(view, "t", wanted=2, poll=0.01))["version"] == 2 and view.reads == 4
    # already recorded, or nothing to wait for: one read
    for wanted in (1, None):
        view = RecordsLater(before=1, recorded=2, after=4)
        assert asyncio.run(recorded_view(view, "t", wanted))["version"] == 1 and view.reads == 1
    # two ahead is never a version in flight: refused at once by the check, without waiting
    view = RecordsLater(before=1, recorded=3, after=2)
    v = asyncio.run(recorded_view(view, "t", wanted=3))["version"]
    assert view.reads == 1
    with pytest.raises(SpecError, match="versions so far are 0..1"):
        check_episodes({**upload(), "policy_version": [3] * 5}, SCHEMA, v, 100, 10)
    # a version that never gets recorded is refused after the wait: on the wait's clock, which here moves
    # 0.05 s per read (not the wall clock), it reads until its 0.2 s have passed and then gives up
    clock = [0.0]

    class Ticking(RecordsLater):
        async def tenant_view(self, tenant: str) -> dict:
            clock[0] += 0.05
            return await super().tenant_view(tenant)

    monkeypatch.setattr(envs, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    view = Ticking(before=1, recorded=2, after=10**9)
    assert asyncio.run(recorded_view(view, "t", wanted=2, timeout=0.2, poll=0.001))["version"] == 1
    assert view.reads == 5 and clock[0] == pytest.approx(0.25)  # the first read, then 0.2 s of polls
