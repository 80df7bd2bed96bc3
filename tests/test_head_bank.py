"""The inference engine's stacked heads (``nexus.model.head_bank``): the same answers as each tenant's head alone."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from nexus.config.service import ServiceConfig
from nexus.config.validation import validate_tenant
from nexus.engine.engine import InferenceEngine, _Request
from nexus.features import Observation
from nexus.model.head_bank import HeadBank, head_shape
from nexus.model.policy import TenantPolicy
from nexus.spec import TenantSpec

FEAT = 64  # the tiny Qwen3-VL's width


def policy(seed: int, hidden: int = 32, chunk: int | None = None, norm: str = "tanh") -> TenantPolicy:
    spec, schema = validate_tenant(TenantSpec(name=f"t{seed}", env="maniskill/pushcube-state", seed=seed,
                                              hidden_dim=hidden, proprio_norm=norm))
    p = TenantPolicy.from_spec(spec, schema, FEAT, chunk=chunk)
    with torch.no_grad():  # distinct, non-trivial weights (a fresh head's last layer is ~0)
        gen = torch.Generator().manual_seed(seed)
        for w in p.parameters():
            w.add_(0.1 * torch.randn(w.shape, generator=gen))
        if norm == "running":  # each tenant's own state statistics
            p.proprio_norm.observe(seed + (seed + 1) * torch.randn(50, 35, generator=gen))
    return p


@pytest.mark.parametrize(("chunk", "norm"), [(1, "tanh"), (3, "tanh"), (1, "running")])
def test_bank_forward_equals_each_head_alone_with_uneven_rows(chunk, norm):
    torch.manual_seed(0)
    policies = {f"t{i}": policy(i, chunk=chunk, norm=norm) for i in range(5)}
    assert head_shape(policy(9, norm="tanh" if norm == "running" else "running")) != head_shape(policies["t0"])
    bank = HeadBank(head_shape(policies["t0"]), capacity=2)  # grows twice on the way
    for name, p in policies.items():
        bank.put(name, p)
    assert bank.capacity == 8 and sorted(bank.slots.values()) == [0, 1, 2, 3, 4]
    tenants = ["t3"] * 3 + ["t0"] + ["t4"] * 5 + ["t1"] * 2  # t2 has no row; rows interleave nothing
    tenants = [tenants[i] for i in np.random.default_rng(1).permutation(len(tenants))]
    pooled, proprio = torch.randn(len(tenants), FEAT), 4 * torch.randn(len(tenants), 35)
    mean, log_std, value = bank.forward(tenants, pooled, proprio)
    assert mean.shape == (len(tenants), chunk * 4) and value.shape == (len(tenants),)
    for r, t in enumerate(tenants):
        p = policies[t]
        want_action, _, want_value = p.act(pooled[r:r + 1], proprio[r:r + 1], deterministic=True)
        torch.testing.assert_close(mean[r], want_action[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(value[r], want_value[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(log_std[r], p.head.log_std.detach())
    # rows of the upper slots only: computed over slots 3-4 (views from the lowest), the same answers
    upper = ["t4", "t3", "t4"]
    assert bank.padded_rows(upper) == 2 * 2
    mean, _, value = bank.forward(upper, pooled[:3], proprio[:3])
    for r, t in enumerate(upper):
        want_action, _, want_value = policies[t].act(pooled[r:r + 1], proprio[r:r + 1], deterministic=True)
        torch.testing.assert_close(mean[r], want_action[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(value[r], want_value[0], rtol=1e-5, atol=1e-6)


def test_slots_follow_the_policy_object_and_are_reused():
    a, b, b2 = policy(1), policy(2), policy(3)
    bank = HeadBank(head_shape(a), capacity=2)
    bank.put("a", a)
    bank.put("b", b)
    assert bank.holds("b", b) and not bank.holds("b", b2)  # a weight sync brings a new object: not current
    bank.put("b", b2)
    assert bank.holds("b", b2) and bank.slots["b"] == 1 and bank.capacity == 2  # the same slot, rewritten
    pooled, proprio = torch.randn(2, FEAT), torch.randn(2, 35)
    mean, _, _ = bank.forward(["b", "a"], pooled, proprio)
    torch.testing.assert_close(mean[0], b2.act(pooled[:1], proprio[:1], deterministic=True)[0][0])
    bank.drop("a")
    assert "a" not in bank.slots and not bank.holds("a", a)
    bank.put("c", policy(4))
    assert bank.slots["c"] == 0  # the freed slot
    with pytest.raises(ValueError, match="head shape"):
        bank.put("d", policy(5, hidden=16))
    assert "d" not in bank.slots


def _engine(tmp_path, bank_tenants: int) -> InferenceEngine:
    eng = InferenceEngine(ServiceConfig(root=str(tmp_path / str(bank_tenants)),
                                        caches={"head_bank_tenants": bank_tenants}))
    for i in range(4):
        spec, schema = validate_tenant(TenantSpec(name=f"t{i}", env="maniskill/pushcube-state", seed=i + 1,
                                                  hidden_dim=32 if i < 3 else 16))
        buf = io.BytesIO()
        torch.save(policy(i + 1, hidden=spec.hidden_dim).state_dict(), buf)
        eng.heads.register(spec, schema, 0, buf.getvalue())
    return eng


def test_engine_group_answers_as_with_the_bank_off(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    on, off = _engine(tmp_path, 64), _engine(tmp_path, 0)
    banked: list[int] = []
    forward = HeadBank.forward
    monkeypatch.setattr(HeadBank, "forward", lambda self, tenants, *a: banked.append(len(tenants)) or
                        forward(self, tenants, *a))
    assert sorted(next(iter(on.heads.banks.values())).slots) == ["t0", "t1", "t2"]  # t3: another shape
    assert not off.heads.banks
    rng = np.random.default_rng(0)
    group = []
    for j in range(14):  # deterministic, seeded and unseeded rows of four tenants, one of them another shape
        obs = Observation(state=rng.normal(size=35).astype(np.float32))
        mode = j % 3
        group.append(_Request(f"t{j % 4}", obs, None, mode == 0, None, features=j == 5,
                              seed=100 + j if mode == 1 else None))
    got, want = on._forward(group), off._forward(group)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["version"] == w["version"] == 0
        np.testing.assert_allclose(g["value"], w["value"], rtol=1e-5, atol=1e-6)
        if j % 3 != 2:  # deterministic or seeded: the same sample
            np.testing.assert_allclose(g["action"], w["action"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(g["logprob"], w["logprob"], rtol=1e-5, atol=1e-5)
        else:  # the engine's own noise: another draw, its log-prob exact under the tenant's head
            p = on.heads.live[group[j].tenant][1]
            feats = on.heads.framework.group_features([(group[j].tenant, on.heads.framework.preprocessors[
                group[j].tenant](group[j].obs))])[group[j].tenant][1]
            proprio = torch.as_tensor(group[j].obs.state)[None]
            with torch.no_grad():
                lp, _, _ = p.evaluate(feats, proprio, torch.as_tensor(g["action"])[None])
            assert float(lp[0]) == pytest.approx(g["logprob"], rel=1e-4, abs=1e-4)
    assert banked == [11]  # t0-t2's rows in one batched forward; t3's (another shape) alone
    assert got[5]["feature"].shape == (FEAT,)
    np.testing.assert_allclose(got[5]["feature"], want[5]["feature"])


def test_a_new_version_replaces_the_banked_head(tmp_path):
    eng = _engine(tmp_path, 64)
    obs = Observation(state=np.linspace(-1, 1, 35).astype(np.float32))
    rows = [_Request("t0", obs, None, True, None), _Request("t1", obs, None, True, None)]
    before = eng._forward(rows)
    buf = io.BytesIO()
    torch.save(policy(42).state_dict(), buf)
    eng.heads.load("t0", 1, buf.getvalue())
    after = eng._forward(rows)
    alone = eng._forward(rows[:1])  # one tenant: its own head call, not the bank
    assert after[0]["version"] == 1 and not np.allclose(after[0]["action"], before[0]["action"])
    np.testing.assert_allclose(after[0]["action"], alone[0]["action"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after[1]["action"], before[1]["action"], rtol=1e-5, atol=1e-6)


def test_the_bank_holds_at_most_its_limit(tmp_path):
    eng = _engine(tmp_path, 2)
    bank = next(iter(eng.heads.banks.values()))
    assert sorted(bank.slots) == ["t0", "t1"]  # t2 runs its head alone
    eng.heads.unregister("t0")
    assert sorted(bank.slots) == ["t1"]
