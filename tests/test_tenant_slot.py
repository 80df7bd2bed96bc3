"""Per-tenant DeepSpeed slots: isolation, checkpoint/restore, weight export, gradient accumulation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nexus.actor.tenant_slot import TenantSlot, ensure_distributed
from nexus.algorithms.ppo import ppo_loss
from nexus.algorithms.sft import sft_loss
from nexus.features import CameraSpec, Observation, TenantSchema
from nexus.model.backbone import BackboneConfig
from nexus.model.policy import TenantPolicy
from nexus.model.preprocessor import TenantPreprocessor
from nexus.spec import PPOConfig, TenantSpec

torch.set_num_threads(1)

SCHEMA_A = TenantSchema(proprio_dim=9, action_dim=7, instruction="pick up the cube",
                        cameras=(CameraSpec("base", 64, 64),))
SCHEMA_B = TenantSchema(proprio_dim=25, action_dim=4, instruction="push the cube to the goal region")


def spec(name: str, seed: int = 0) -> TenantSpec:
    return TenantSpec(name=name, env="maniskill/pushcube-state", seed=seed, hidden_dim=32, lr=1e-2,
                      weight_decay=0.01)


def batch(tiny_backbone, schema: TenantSchema, seed: int, n: int = 8):
    """Real backbone features, proprio and target actions for one tenant."""
    rng = np.random.default_rng(seed)
    pre = TenantPreprocessor(schema, BackboneConfig(size="tiny", image_size=64))
    obs = [Observation(state=rng.normal(size=schema.proprio_dim).astype(np.float32),
                       images={c.name: rng.integers(0, 256, (c.height, c.width, 3), dtype=np.uint8)
                               for c in schema.cameras}) for _ in range(n)]
    feats = pre.batch(obs)
    x = tiny_backbone.encode(feats)
    proprio = torch.from_numpy(np.stack([f.proprio for f in feats]))
    actions = torch.from_numpy(rng.uniform(-1, 1, (n, schema.action_dim)).astype(np.float32))
    return x, proprio, actions


def sft(b):
    return lambda policy: sft_loss(policy, *b)


def params(slot: TenantSlot) -> list[torch.Tensor]:
    return [p.detach().clone() for p in slot.policy.parameters()]


def opt_state(slot: TenantSlot) -> list[torch.Tensor]:
    """Every tensor of the slot's optimizer: torch AdamW moments/steps and ZeRO's fp32 master partitions."""
    zero = slot.engine.optimizer
    tensors = [t.detach().clone() for st in zero.optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor)]
    tensors += [t.detach().clone() for t in zero.single_partition_of_fp32_groups]
    assert tensors
    return tensors


def all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def data(tiny_backbone):
    return batch(tiny_backbone, SCHEMA_A, 0), batch(tiny_backbone, SCHEMA_B, 1)


def test_ensure_distributed_is_idempotent():
    ensure_distributed()
    ensure_distributed()
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1


def test_step_of_one_tenant_leaves_the_other_untouched(tiny_backbone, data):
    a = TenantSlot(spec("a", 1), SCHEMA_A, tiny_backbone.hidden_size)
    b = TenantSlot(spec("b", 2), SCHEMA_B, tiny_backbone.hidden_size)
    assert a.engine.zero_optimization_stage() == 2
    b.train_step(sft(data[1]))  # give B real optimizer state first
    b_params, b_opt = params(b), opt_state(b)
    a_before = params(a)
    for _ in range(3):
        stats = a.train_step(sft(data[0]))
    assert {"loss", "mse", "grad_norm", "lr"} <= set(stats)
    assert all(isinstance(v, float) for v in stats.values())
    assert not all_equal(a_before, params(a))  # A did move
    assert all_equal(b_params, params(b))
    assert all_equal(b_opt, opt_state(b))


def test_checkpoint_restore_then_identical_next_step(tiny_backbone, data, tmp_path):
    src = TenantSlot(spec("ckpt", 3), SCHEMA_A, tiny_backbone.hidden_size)
    for _ in range(2):
        src.train_step(sft(data[0]))
    assert src.bump_version() == 1
    src.train_step(sft(data[0]))
    assert src.bump_version() == 2
    path = src.save_checkpoint(str(tmp_path))
    assert path.endswith("v2") and (tmp_path / "version").read_text().strip() == "2"

    fresh = TenantSlot(spec("ckpt", 99), SCHEMA_A, tiny_backbone.hidden_size)  # different init
    assert not all_equal(params(src), params(fresh))
    fresh.load_checkpoint(str(tmp_path))  # tag None -> DeepSpeed's "latest"
    assert fresh.version == 2
    assert all_equal(params(src), params(fresh))
    assert all_equal(opt_state(src), opt_state(fresh))

    # PPO step on both: identical parameters only if the optimizer state came back exactly
    x, proprio, _ = data[0]
    actions, logprob, _ = src.policy.act(x, proprio, generator=torch.Generator().manual_seed(0))
    adv, ret = torch.linspace(-1, 1, x.shape[0]), torch.zeros(x.shape[0])
    for slot in (src, fresh):
        slot.train_step(lambda pol: ppo_loss(pol, x, proprio, actions, logprob, adv, ret, PPOConfig()))
    assert all_equal(params(src), params(fresh))
    assert all_equal(opt_state(src), opt_state(fresh))

    older = TenantSlot(spec("ckpt", 5), SCHEMA_A, tiny_backbone.hidden_size)
    src.version = 7
    src.save_checkpoint(str(tmp_path))
    older.load_checkpoint(str(tmp_path), tag="v2")  # an explicit older tag
    assert older.version == 2
    with pytest.raises(FileNotFoundError):
        older.load_checkpoint(str(tmp_path / "nothing-here"))


def test_export_weights_roundtrip(tiny_backbone, data):
    slot = TenantSlot(spec("export", 4), SCHEMA_B, tiny_backbone.hidden_size)
    slot.train_step(sft(data[1]))
    blob = slot.export_weights()
    assert isinstance(blob, bytes)
    policy = TenantPolicy.from_bytes(blob, spec("export", 4), SCHEMA_B, tiny_backbone.hidden_size)
    x, proprio, actions = data[1]
    for got, want in zip(policy.evaluate(x, proprio, actions), slot.policy.evaluate(x, proprio, actions),
                         strict=True):
        assert torch.equal(got, want)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for got, want in zip(policy.act(x, proprio, generator=g1), slot.policy.act(x, proprio, generator=g2),
                         strict=True):
        assert torch.equal(got, want)


def test_gradient_accumulation_sums_micro_batches(tiny_backbone, data):
    x, proprio, actions = data[0]
    half1 = (x[:4], proprio[:4], actions[:4])
    half2 = (x[4:], proprio[4:], actions[4:])
    acc = TenantSlot(spec("acc", 6), SCHEMA_A, tiny_backbone.hidden_size)
    ref = TenantSlot(spec("acc", 6), SCHEMA_A, tiny_backbone.hidden_size)
    assert all_equal(params(acc), params(ref))
    with pytest.raises(RuntimeError, match="without a forward_backward"):
        acc.optim_step()

    for _ in range(2):  # two rounds: the accumulation buffers must also reset correctly after a step
        acc.forward_backward(sft(half1))
        acc.forward_backward(sft(half2))
        step = acc.optim_step()
        assert step["grad_norm"] > 0

        def both(policy):
            (l1, _), (l2, _) = sft_loss(policy, *half1), sft_loss(policy, *half2)
            return l1 + l2, {}

        ref.train_step(both)
        for p, q in zip(params(acc), params(ref), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fp32_master_is_a_view_of_the_weights_and_updates_are_unchanged(tiny_backbone, data, tmp_path, monkeypatch):
    """ZeRO's fp32 master partition shares the weights' storage (no duplicate per tenant), its buckets are the
    slot's size, no per-parameter links into the master are kept and equal engines share one parsed config;
    every update, a checkpoint's restore included, equals a plain DeepSpeed engine (the master its own copy)."""
    import nexus.actor.tenant_slot as tenant_slot

    shared = TenantSlot(spec("lean", 8), SCHEMA_A, tiny_backbone.hidden_size)
    twin = TenantSlot(spec("lean", 8), SCHEMA_A, tiny_backbone.hidden_size)
    monkeypatch.setattr(tenant_slot, "slim_engine", lambda engine: None)
    monkeypatch.setattr(tenant_slot, "drop_hp_links", lambda engine: 0)
    copied = TenantSlot(spec("lean", 8), SCHEMA_A, tiny_backbone.hidden_size)
    monkeypatch.undo()
    assert twin.engine._config is shared.engine._config is not copied.engine._config
    assert twin.engine.monitor is shared.engine.monitor and not shared.engine.monitor.enabled
    assert shared.engine.gradient_clipping() == copied.engine.gradient_clipping() == 1.0
    zero = shared.engine.optimizer
    (master,) = zero.single_partition_of_fp32_groups
    weights = {p.untyped_storage().data_ptr() for p in shared.policy.parameters()}
    assert master.untyped_storage().data_ptr() in weights
    assert copied.engine.optimizer.single_partition_of_fp32_groups[0].untyped_storage().data_ptr() not in {
        p.untyped_storage().data_ptr() for p in copied.policy.parameters()}
    n = sum(p.numel() for p in shared.policy.parameters())
    assert shared.optimizer_bytes() == 0  # AdamW's moments come with the first step
    # ZeRO's gradient / all-gather buckets hold this slot's parameters, not the 5e8-element defaults
    assert n <= zero.reduce_bucket_size == zero.allgather_bucket_size < n + 128
    assert any(p._hp_mapping is not None for p in copied.policy.parameters())
    for slot in (shared, twin, copied):
        with monkeypatch.context() as m:
            if slot is copied:  # a plain engine: DeepSpeed re-links every parameter at a load
                m.setattr(tenant_slot, "drop_hp_links", lambda engine: 0)
            for _ in range(2):
                slot.train_step(sft(data[0]))
            slot.save_checkpoint(str(tmp_path / slot.name / str(id(slot))))
            slot.train_step(sft(data[0]))  # undone by the restore
            slot.load_checkpoint(str(tmp_path / slot.name / str(id(slot))))
            slot.train_step(sft(data[0]))
    assert all_equal(params(shared), params(copied)) and all_equal(params(twin), params(copied))
    assert all_equal(opt_state(shared)[:-1], opt_state(copied)[:-1])  # the moments (the last: the master)
    assert master.untyped_storage().data_ptr() in {p.untyped_storage().data_ptr()
                                                   for p in shared.policy.parameters()}, "still a view after a restore"
    # the load re-linked them; the slot drops them again
    assert any(p._hp_mapping is not None for p in copied.policy.parameters())
    assert all(p._hp_mapping is None and "get_full_hp_param" not in vars(p) for p in shared.policy.parameters())
    # AdamW's two fp32 moments (+ its step counter): no master copy counted
    assert 8 * n <= shared.optimizer_bytes() <= 8 * n + 64
    assert copied.optimizer_bytes() >= 12 * n
