"""RL for a flow-matching family through a real local service: a π-head tenant's PPO and GRPO jobs on PushCube run
and change its policy, the log-probability the engine reports for a sampled action is the one the actor recomputes
(``forward``), and the exported policy acts deterministically, as the service's deterministic predict does.

How well such a tenant learns is measured by ``experiments/rl_learning/flow_rl.py``, not here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.export import policy as exported
from nexus.features import Observation
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster

ENV = "maniskill/pushcube-state"


@pytest.fixture(scope="module")
def nx(tmp_path_factory):
    with Nexus.local(tmp_path_factory.mktemp("flowrl"), n_sim=1) as nexus:
        yield nexus


def test_ppo_and_grpo_train_a_pi_tenant_whose_export_acts_deterministically(nx, tmp_path):
    t = nx.create_tenant(TenantSpec(name="pi-rl", env=ENV, action_head="pi", hidden_dim=32, seed=1))
    obs = Observation(state=np.linspace(-0.5, 0.5, 35).astype(np.float32), instruction="push the cube")
    v0 = t.predict_action(obs).result(60)["action"]

    # the engine's sample and its log-probability; the actor's recomputation of it, on the same weights
    sample = t.predict_action(obs, deterministic=False, seed=7).result(60)
    again = t.forward({"observations": [{"state": obs.state, "instruction": obs.instruction}],
                       "actions": [sample["action"]]}).result(60)
    assert math.isfinite(sample["logprob"])
    assert again["logprobs"][0] == pytest.approx(sample["logprob"], abs=1e-4)

    ppo = t.submit({"kind": "rl", "updates": 2, "episodes_per_batch": 2,
                    "ppo": {"update_epochs": 2, "minibatch_size": 50}}).result(timeout=600)
    grpo = t.submit({"kind": "rl", "algorithm": "grpo", "updates": 1, "episodes_per_batch": 4,
                     "grpo": {"group_size": 2, "update_epochs": 2, "minibatch_size": 100}}).result(timeout=600)
    assert (ppo["updates"], grpo["updates"]) == (2, 1)
    train = [h for j in nx.tenant_log("pi-rl")["jobs"] for h in j.get("history", []) if h.get("kind") == "train"]
    assert len(train) == 3
    for h in train:  # the losses of both algorithms were computed on real log-probabilities
        assert all(math.isfinite(h[k]) for k in ("pg_loss", "approx_kl", "entropy")), h
    assert "v_loss" in train[0] and "group_return_std" in train[-1]

    live = t.predict_action(obs).result(60)
    assert live["version"] == 3
    assert np.abs(live["action"] - v0).max() > 1e-6  # the updates moved the deterministic action

    info = t.export(path=tmp_path / "pi-rl")
    policy = exported.load(info["local_path"])
    first = policy.predict_action({"state": obs.state, "instruction": obs.instruction})
    second = policy.predict_action({"state": obs.state, "instruction": obs.instruction})
    assert first["version"] == 3
    np.testing.assert_array_equal(first["action"], second["action"])  # noise off: the same action twice
    np.testing.assert_allclose(first["action"], live["action"], atol=1e-5)  # ... and the service's deterministic one
