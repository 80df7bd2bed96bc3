"""Uploaded episodes (external rollouts) checked where they enter: numbering, refusals (no cluster)."""

from __future__ import annotations

import numpy as np
import pytest

from nexus.episodes import check_episodes
from nexus.errors import LimitExceeded, SpecError
from nexus.features import CameraSpec, TenantSchema

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
