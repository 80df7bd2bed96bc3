"""Action-module families (OFT, GR00T, π): shapes, learning, grouped == serial, isolation, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nexus.actor.tenant_slot import TenantSlot
from nexus.algorithms.grpo import GRPOConfig, group_advantages, grpo_loss
from nexus.algorithms.sft import ActionChunks, sft_loss
from nexus.config.validation import SpecError, validate_job
from nexus.features import TenantSchema
from nexus.model.backbone import BackboneConfig
from nexus.model.backbone_features import BackboneFeatures
from nexus.model.flow_matching import FlowConfig, integrate, interpolate, sample_tau
from nexus.model.framework import VLAFramework
from nexus.model.policy import TenantPolicy
from nexus.model.preprocessor import TenantPreprocessor
from nexus.model.synthetic_tenants import CALVIN_LIKE, LIBERO_LIKE, SyntheticTenant
from nexus.spec import TenantSpec

torch.set_num_threads(1)

FAMILIES = ("oft", "groot", "pi")
QWEN64 = BackboneConfig(size="tiny", image_size=64)
PG64 = BackboneConfig(family="paligemma", size="tiny", image_size=64)
BACKBONE_OF = {"oft": QWEN64, "groot": QWEN64, "pi": PG64}  # as in the paper: StarVLA-Qwen, OpenPI-PaliGemma
CHUNK = 4


def spec(name: str, family: str, seed: int = 0, chunk: int = CHUNK, **kw) -> TenantSpec:
    return TenantSpec(name=name, env="maniskill/pushcube-state", action_head=family, hidden_dim=32, chunk=chunk,
                      seed=seed, **kw)


@pytest.fixture(scope="module")
def framework(tiny_backbone, tiny_paligemma) -> VLAFramework:
    return VLAFramework(tiny_backbone, tiny_paligemma)


def encode(fw: VLAFramework, family: str, schema: TenantSchema, seed: int, n: int = 6):
    """Real backbone features (the family's layers), proprio and chunked actions of one synthetic tenant."""
    observations, actions = SyntheticTenant(schema, chunk=CHUNK).batch(n, seed)
    pre = TenantPreprocessor(schema, BACKBONE_OF[family])
    layers = TenantPolicy.from_spec(spec("probe", family), schema, 64).prefix_layers
    feats = pre.batch(observations)
    cond = fw.backbone_for(pre.compat_key).encode_prefix(feats, layers)
    return cond, torch.from_numpy(np.stack([f.proprio for f in feats])), torch.from_numpy(actions)


# -- shapes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_and_deterministic_init(family, framework):
    cond, proprio, actions = encode(framework, family, LIBERO_LIKE, 0)
    state = torch.random.get_rng_state()
    a = TenantPolicy.from_spec(spec("p", family, seed=3), LIBERO_LIKE, 64)
    assert torch.equal(state, torch.random.get_rng_state())
    b = TenantPolicy.from_spec(spec("p", family, seed=3), LIBERO_LIKE, 64)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert a.family == family and a.chunk == CHUNK and a.action_size == CHUNK * 7
    assert a.gaussian == (family == "oft") and a.value is not None  # every family has a critic (RL)
    assert a.prefix_layers == {"oft": (), "groot": (-1,), "pi": (-2, -1)}[family]

    action, logprob, value = a.act(cond, proprio)
    assert action.shape == (6, CHUNK * 7) and logprob.shape == value.shape == (6,)
    assert torch.isfinite(action).all() and torch.isfinite(logprob).all()
    det = a.mean_action(cond, proprio)
    assert det.shape == (6, CHUNK * 7)
    torch.testing.assert_close(a.act(cond, proprio, deterministic=True)[0], det)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(a.act(cond, proprio, generator=g1)[0], a.act(cond, proprio, generator=g2)[0])
    # the sampled action's log-probability (a flow's: its last denoising step's Gaussian) is evaluate()'s,
    # recomputed with autograd, also at the deterministic action, where it is the density's peak
    lp, ent, v = a.evaluate(cond, proprio, action)
    torch.testing.assert_close(lp, logprob)
    torch.testing.assert_close(v, value)
    at_mean = a.act(cond, proprio, deterministic=True)[1]
    torch.testing.assert_close(a.evaluate(cond, proprio, det)[0], at_mean)
    assert (at_mean > logprob).all()
    assert lp.requires_grad and ent.shape == v.shape == (6,)
    lp.sum().backward()  # the gradient reaches the head's own weights (a flow's: back through its Euler chain)
    assert a.head.log_std.grad is not None
    assert sum(p.grad.abs().sum() for n, p in a.head.named_parameters() if p.grad is not None and n != "log_std") > 0
    if family == "oft":
        # plain (an engine's functional layers): the same answers as the modules'
        for kw in ({"deterministic": True}, {"noise": torch.randn(6, CHUNK * 7)}):
            for x, y in zip(a.act(cond, proprio, plain=True, **kw), a.act(cond, proprio, **kw), strict=True):
                torch.testing.assert_close(x, y)
    else:
        x = torch.randn(6, CHUNK, 7)
        assert a.velocity(cond, proprio, x, torch.rand(6)).shape == (6, CHUNK, 7)
        with pytest.raises(ValueError, match="no prefix tokens|not in these features"):
            a.mean_action(cond.pooled, proprio)  # flow experts need the prefix tokens


def test_flow_matching_pieces():
    cfg = FlowConfig(steps=8)
    tau = sample_tau(10_000, cfg, torch.Generator().manual_seed(0))
    assert 0.0 <= tau.min() and tau.max() <= cfg.time_max
    assert tau.mean() < 0.5  # Beta(1.5, 1) on 1 - tau: more samples near the noise end
    a, e = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    x, v = interpolate(a, e, torch.tensor([0.0, 0.5, 1.0]))
    torch.testing.assert_close(x[0], e[0]) and torch.testing.assert_close(x[2], a[2])
    torch.testing.assert_close(v, a - e)
    # the exact velocity field of one pair carries noise to data in any number of Euler steps
    torch.testing.assert_close(integrate(lambda xt, t: a - e, e, steps=3), a)


@pytest.mark.parametrize("family", ("groot", "pi"))
def test_a_flow_head_inpaints_an_executed_prefix(family, framework):
    """Real-time chunking: the chunk ends on the executed prefix exactly, a row without one is as without any, and
    the rest of a prefixed row is planned after the prefix (the chunk's attention sees it), deterministic or not."""
    cond, proprio, _ = encode(framework, family, LIBERO_LIKE, 0, n=2)
    policy = TenantPolicy.from_spec(spec("p", family, seed=3), LIBERO_LIKE, 64)
    if family == "groot":  # adaLN-Zero: a fresh DiT's blocks are the identity, its positions meet once trained
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for block in policy.head.blocks:
                block.modulation.weight.copy_(0.05 * torch.randn(block.modulation.weight.shape, generator=g))
    a = policy.action_dim
    target = torch.zeros(2, CHUNK, a)
    mask = torch.zeros(2, CHUNK, 1)
    target[0, :2], mask[0, :2] = 0.7, 1.0  # row 0: two executed actions; row 1: none
    for det in (True, False):
        plain = policy.act(cond, proprio, deterministic=det, generator=torch.Generator().manual_seed(1))[0]
        rtc = policy.act(cond, proprio, deterministic=det, generator=torch.Generator().manual_seed(1),
                         prefix=(target, mask))[0]
        plain, rtc = plain.view(2, CHUNK, a), rtc.view(2, CHUNK, a)
        torch.testing.assert_close(rtc[0, :2], target[0, :2])
        torch.testing.assert_close(rtc[1], plain[1])
        assert (rtc[0, 2:] - plain[0, 2:]).abs().max() > 1e-6


# -- learning --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_loss_falls_on_a_fixed_batch(family, framework):
    cond, proprio, actions = encode(framework, family, CALVIN_LIKE, 1, n=8)
    policy = TenantPolicy.from_spec(spec("sft", family), CALVIN_LIKE, 64)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        # a fixed generator seed: the same noise and flow times every step (a fixed objective)
        loss, stats = sft_loss(policy, cond, proprio, actions, torch.Generator().manual_seed(0))
        assert set(stats) == ({"mse"} if family == "oft" else {"flow_mse"})
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses[::10]


# -- group batching: grouped == serial, isolation ------------------------------------------------------


def _tenants(framework: VLAFramework) -> dict[str, tuple[str, TenantSchema]]:
    """Heterogeneous tenants of every family, on both backbones."""
    return {"lib-oft": ("oft", LIBERO_LIKE), "cal-groot": ("groot", CALVIN_LIKE), "lib-groot": ("groot", LIBERO_LIKE),
            "cal-pi": ("pi", CALVIN_LIKE), "lib-pi": ("pi", LIBERO_LIKE), "cal-oft": ("oft", CALVIN_LIKE)}


def _register(framework: VLAFramework, slots: bool = False, seed0: int = 0) -> dict[str, object]:
    made = {}
    for i, (name, (family, schema)) in enumerate(_tenants(framework).items()):
        s = spec(name, family, seed=seed0 + i, lr=1e-2)
        made[name] = TenantSlot(s, schema, 64) if slots else TenantPolicy.from_spec(s, schema, 64)
        policy = made[name].policy if slots else made[name]
        framework.add_tenant(name, policy, TenantPreprocessor(schema, BACKBONE_OF[family]))
    return made


def _requests(framework: VLAFramework, seed: int, n: int = 3):
    reqs, actions = [], {}
    for i, (name, (_, schema)) in enumerate(_tenants(framework).items()):
        observations, acts = SyntheticTenant(schema, chunk=CHUNK).batch(n, (seed, i))
        reqs += [(name, framework.preprocess(name, o)) for o in observations]
        actions[name] = torch.from_numpy(acts)
    order = np.random.default_rng(seed).permutation(len(reqs))  # tenants' requests arrive interleaved
    return [reqs[i] for i in order], actions


def _proprio(reqs, idx) -> torch.Tensor:
    return torch.from_numpy(np.stack([reqs[i][1].proprio for i in idx]))


def test_grouped_equals_serial_features_and_gradients(tiny_backbone, tiny_paligemma):
    fw = VLAFramework(tiny_backbone, tiny_paligemma)
    policies = _register(fw)
    reqs, actions = _requests(fw, 0)
    q0, p0 = tiny_backbone.forward_calls, tiny_paligemma.forward_calls
    grouped = fw.group_features(reqs)
    assert (tiny_backbone.forward_calls - q0, tiny_paligemma.forward_calls - p0) == (1, 1)
    for name, (idx, cond) in grouped.items():
        policy = policies[name]
        alone_idx, alone = fw.group_features([reqs[i] for i in idx])[name]
        assert alone_idx == list(range(len(idx)))
        torch.testing.assert_close(cond.pooled, alone.pooled, rtol=1e-5, atol=1e-5)
        if cond.tokens is not None:
            assert cond.tokens.shape == alone.tokens.shape and torch.equal(cond.mask, alone.mask)
            torch.testing.assert_close(cond.tokens, alone.tokens, rtol=1e-5, atol=1e-5)
        order = [reqs[i] for i in idx]
        target = actions[name][[int(np.flatnonzero([r is q for q in order])[0]) for r in order]]
        grads = []
        for feats in (cond, alone):
            policy.zero_grad()
            loss, _ = sft_loss(policy, feats, _proprio(reqs, idx), target, torch.Generator().manual_seed(7))
            loss.backward()
            grads.append([p.grad.clone() for p in policy.parameters() if p.grad is not None])
        assert grads[0], name
        for g, s in zip(*grads, strict=True):
            torch.testing.assert_close(g, s, rtol=1e-4, atol=1e-6)


def _params(slot: TenantSlot) -> list[torch.Tensor]:
    return [p.detach().clone() for p in slot.policy.parameters()]


def _opt_state(slot: TenantSlot) -> list[torch.Tensor]:
    zero = slot.engine.optimizer
    return [t.detach().clone() for st in zero.optimizer.state.values() for t in st.values()
            if isinstance(t, torch.Tensor)] + [t.detach().clone() for t in zero.single_partition_of_fp32_groups]


def _step(slot: TenantSlot, cond: BackboneFeatures, proprio: torch.Tensor, target: float, seed: int) -> None:
    slot.train_step(lambda p: sft_loss(p, cond, proprio, torch.full((len(proprio), p.action_size), target),
                                       torch.Generator().manual_seed(seed)))


def _adam_view(slot: TenantSlot) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The slot's flat fp32 parameters, the bias-corrected RMS of its gradients (Adam's sqrt(v_hat), same
    layout) and its learning rate."""
    zero = slot.engine.optimizer
    flat = zero.single_partition_of_fp32_groups[0]
    st, group = zero.optimizer.state[flat], zero.optimizer.param_groups[0]
    v_hat = st["exp_avg_sq"] / (1 - group["betas"][1] ** float(st["step"]))
    return flat.detach().clone(), v_hat.sqrt(), group["lr"]


def test_isolation_between_families_in_one_grouped_step(tiny_backbone, tiny_paligemma):
    """One grouped forward for six tenants of three families; each steps on its own rows only: an idle
    tenant is untouched, the others end where the same tenant stepped alone ends (as far as float
    arithmetic and Adam allow, see below)."""
    targets = {"lib-oft": 1e3}  # absurd targets for one tenant must not leak into any other
    idle = "cal-pi"

    def history(fw: VLAFramework, slots: dict, grouped: bool) -> None:
        for step in (1, 2):
            reqs, _ = _requests(fw, step)
            per_tenant = fw.group_features(reqs)
            for name, (idx, cond) in per_tenant.items():
                if step == 2 and name == idle:
                    continue
                if not grouped:  # the serial baseline: this tenant's own forward
                    alone = fw.group_features([reqs[i] for i in idx])[name][1]
                    # the guarantee group batching makes: the same features, up to float rounding
                    torch.testing.assert_close(alone.pooled, cond.pooled, rtol=1e-5, atol=1e-5)
                    cond = alone
                _step(slots[name], cond, _proprio(reqs, idx), targets.get(name, 0.5) * step, step)

    fw = VLAFramework(tiny_backbone, tiny_paligemma)
    slots = _register(fw, slots=True)
    reqs, _ = _requests(fw, 1)
    for name, (idx, cond) in fw.group_features(reqs).items():  # step 1 for everyone: real optimizer state
        _step(slots[name], cond, _proprio(reqs, idx), targets.get(name, 0.5), 1)
    before = {n: (_params(s), _opt_state(s)) for n, s in slots.items()}
    reqs, _ = _requests(fw, 2)
    q0 = tiny_backbone.forward_calls
    for name, (idx, cond) in fw.group_features(reqs).items():
        if name != idle:
            _step(slots[name], cond, _proprio(reqs, idx), targets.get(name, 0.5) * 2, 2)
    assert tiny_backbone.forward_calls == q0 + 1
    for name, slot in slots.items():
        same = [torch.equal(a, b) for a, b in zip(before[name][0], _params(slot), strict=True)]
        assert all(same) == (name == idle), name
    assert all(torch.equal(a, b) for a, b in zip(before[idle][1], _opt_state(slots[idle]), strict=True))

    twin_fw = VLAFramework(tiny_backbone, tiny_paligemma)
    twins = _register(twin_fw, slots=True)  # same seeds: same initial weights
    history(twin_fw, twins, grouped=False)
    # Adam's step lr * m_hat / (sqrt(v_hat) + eps) is scale-free in the gradient: where the gradient stands
    # clear of eps, float rounding of the features moves the step by a rounding-sized fraction of lr (we
    # allow 1e-3 lr). Where the gradient is itself rounding residue (sqrt(v_hat) below 10 eps, e.g. 1e-11 for
    # weights that barely touch the loss), its relative error is large and Adam turns it into a step of up
    # to lr: there we only assert Adam's bound, at most lr per step (measured on this machine: 1.2e-4 =
    # 0.012 lr for one element of 2 x 92 392; clear elements within 1.5e-6).
    for name in slots:
        (a, g_rms, lr), (b, _, _) = _adam_view(slots[name]), _adam_view(twins[name])
        steps = 1 if name == idle else 2
        clear = g_rms >= 10 * slots[name].engine.optimizer.optimizer.param_groups[0]["eps"]
        diff = (a - b).abs()
        assert float(diff[clear].max()) <= 1e-3 * lr, (name, float(diff[clear].max()))
        assert float(diff.max()) <= steps * lr, (name, float(diff.max()))
        loose = ~clear & (diff > 1e-3 * lr)
        assert int(loose.sum()) <= 1e-3 * diff.numel(), name  # the loose bound is needed by few elements


# -- checkpoints -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_and_weights_roundtrip(family, framework, tmp_path):
    cond, proprio, actions = encode(framework, family, LIBERO_LIKE, 4)
    s = spec(f"ck-{family}", family, seed=5, lr=1e-2)
    src = TenantSlot(s, LIBERO_LIKE, 64)
    assert src.chunk == CHUNK
    for step in range(2):
        src.train_step(lambda p, k=step: sft_loss(p, cond, proprio, actions, torch.Generator().manual_seed(k)))
    src.bump_version()
    src.save_checkpoint(str(tmp_path))
    fresh = TenantSlot(spec(f"ck-{family}", family, seed=99), LIBERO_LIKE, 64)
    fresh.load_checkpoint(str(tmp_path))
    assert fresh.version == 1
    assert all(torch.equal(a, b) for a, b in zip(_params(src), _params(fresh), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_opt_state(src), _opt_state(fresh), strict=True))
    for slot in (src, fresh):  # optimizer state came back exactly: the next step is identical
        slot.train_step(lambda p: sft_loss(p, cond, proprio, actions, torch.Generator().manual_seed(9)))
    assert all(torch.equal(a, b) for a, b in zip(_params(src), _params(fresh), strict=True))

    policy = TenantPolicy.from_bytes(src.export_weights(), s, LIBERO_LIKE, 64)
    assert policy.chunk == CHUNK and policy.family == family
    for det in (True, False):
        g1, g2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
        # (ZeRO keeps parameters as views of one flat buffer: kernels may round differently, ~1e-9)
        for got, want in zip(policy.act(cond, proprio, det, g1), src.policy.act(cond, proprio, det, g2),
                             strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


# -- service integration: spec validation, inference engine, chunked SFT targets ------------------------


@pytest.mark.parametrize("family", ["groot", "pi"])
def test_flow_weights_saved_before_rl_load_with_initial_noise_and_critic(family):
    """A flow policy's weights from before flow RL (no ``head.log_std``, no critic) load: those keep their
    initial values, the rest is the saved policy's; a state with a different std is loaded as saved."""
    saved = TenantPolicy.from_spec(spec("old", family, seed=1), LIBERO_LIKE, 64)
    old = {k: v for k, v in saved.state_dict().items() if k != "head.log_std" and not k.startswith("value.")}
    fresh = TenantPolicy.from_spec(spec("old", family, seed=2), LIBERO_LIKE, 64)
    init_value = {k: v.clone() for k, v in fresh.state_dict().items() if k.startswith("value.")}
    fresh.load_state_dict(old)
    assert torch.equal(fresh.head.log_std, torch.full_like(fresh.head.log_std, -0.5))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in init_value.items())
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in old.items())
    new = saved.state_dict() | {"head.log_std": torch.zeros_like(saved.head.log_std)}
    fresh.load_state_dict(new)
    assert torch.equal(fresh.head.log_std, torch.zeros_like(fresh.head.log_std))


def test_rl_is_accepted_for_every_family_and_refused_for_chunks():
    for family in FAMILIES:
        assert validate_job(spec("f", family, chunk=1), {"kind": "rl"}).algorithm == "ppo"
        assert validate_job(spec("f", family, chunk=1), {"kind": "rl", "algorithm": "grpo", "episodes_per_batch": 4}
                            ).algorithm == "grpo"
        validate_job(spec("f", family), {"kind": "eval"})
        with pytest.raises(SpecError, match="chunk=4"):
            validate_job(spec("c", family, chunk=4), {"kind": "rl"})
    validate_job(spec("o", "oft", chunk=1), {"kind": "rl"})
    with pytest.raises(ValueError, match="multiple of 4"):
        TenantSpec(name="w", env="maniskill/pushcube-state", action_head="pi", hidden_dim=30)


def test_inference_engine_serves_every_family(tiny_backbone, tiny_paligemma, tmp_path):
    """``InferenceEngine._forward``: mixed families and backbones in one group; chunks -> first action."""
    from nexus.engine.engine import InferenceEngine, _Request

    engine = InferenceEngine({"root": str(tmp_path)})
    fw = engine.heads.framework = VLAFramework(tiny_backbone, tiny_paligemma)
    policies = _register(fw)
    for name, policy in policies.items():
        engine.heads.live[name] = (0, policy)
    rng = np.random.default_rng(0)
    group = []
    for name, (_, schema) in _tenants(fw).items():
        observations, _ = SyntheticTenant(schema).batch(2, int(rng.integers(1 << 30)))
        group += [_Request(name, o, None, True, job=None) for o in observations]
    outs = engine._forward(group)
    for r, out in zip(group, outs, strict=True):
        policy = policies[r.tenant]
        assert out["action"].shape == (7,) and out["chunk"].shape == (CHUNK * 7,)
        np.testing.assert_array_equal(out["action"], out["chunk"][:7])
        feat = fw.preprocess(r.tenant, r.obs)
        alone = fw.group_features([(r.tenant, feat)])[r.tenant][1]
        want = policy.mean_action(alone, torch.from_numpy(feat.proprio[None]))[0].detach().numpy()
        np.testing.assert_allclose(out["chunk"], want, atol=1e-4)


def test_action_chunks_targets():
    episode = np.array([0, 0, 0, 1, 1])
    step = np.array([0, 1, 2, 0, 1])
    action = np.arange(10, dtype=np.float32).reshape(5, 2)
    chunks = ActionChunks(episode, step, action)
    got = chunks.targets(np.array([0, 1, 0]), np.array([1, 0, 2]), chunk=3)
    np.testing.assert_array_equal(got, [[2, 3, 4, 5, 4, 5], [6, 7, 8, 9, 8, 9], [4, 5, 4, 5, 4, 5]])


@pytest.mark.parametrize("family", ["oft", "pi"])
def test_grpo_group_advantages_and_loss(framework, family):
    adv = group_advantages(np.array([1.0, 3.0, 5.0, 5.0, 2.0]), np.array([0, 0, 0, 1, 1]))
    np.testing.assert_allclose(adv[:3], [-1.2247, 0.0, 1.2247], atol=1e-3)
    np.testing.assert_allclose(adv[3:], [1.0, -1.0], atol=1e-3)
    cond, proprio, _ = encode(framework, family, LIBERO_LIKE, 6, n=8)
    policy = TenantPolicy.from_spec(spec("grpo", family, chunk=1), LIBERO_LIKE, 64)
    actions, old_logprob, _ = policy.act(cond, proprio, generator=torch.Generator().manual_seed(0))
    returns = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.5, 3.0, 0.0, 1.0])
    advantages = group_advantages(returns, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    # small steps: a flow's mean is its whole Euler chain, which moves more per step than an MLP's output
    opt = torch.optim.AdamW(policy.parameters(), lr=2e-4)
    first = None
    for _ in range(6):
        loss, stats = grpo_loss(policy, cond, proprio, actions, old_logprob, advantages, GRPOConfig(kl_coef=0.1),
                                ref_logprob=old_logprob)
        first = first or stats
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first["approx_kl"] == pytest.approx(0.0, abs=1e-6) and first["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert stats["pg_loss"] < first["pg_loss"] and stats["kl_ref"] > 0
    # better-than-group actions became more likely
    new_lp, _, _ = policy.evaluate(cond, proprio, actions)
    assert float(((new_lp.detach() - old_logprob) * advantages).sum()) > 0


def test_service_sft_update_trains_a_chunked_flow_tenant(tmp_path):
    """``actor_tasks.update_sft`` on the recorded PickCube demos: π expert, chunk 4, held-out error."""
    from nexus.actor.host import ActorHost
    from nexus.actor.tasks import update_sft
    from nexus.config import catalog
    from nexus.config.service import ServiceConfig
    from nexus.wire.messages import SFTWork

    cfg = ServiceConfig(root=str(tmp_path), backbone={"family": "paligemma", "size": "tiny", "image_size": 64})
    svc = ActorHost(cfg)
    schema = catalog.dataset("pickcube-scripted").schema
    s = TenantSpec(name="pick-pi", dataset="pickcube-scripted", action_head="pi", chunk=4, hidden_dim=32, lr=3e-3)
    svc.slots[s.name] = slot = TenantSlot(s, schema, svc.feat_dim)
    svc.framework.add_tenant(s.name, slot.policy, TenantPreprocessor(schema, svc.backbone_cfg))
    first = update_sft(svc, slot, SFTWork("pickcube-scripted", 0, 16, eval_heldout=True))
    for step in range(1, 6):
        last = update_sft(svc, slot, SFTWork("pickcube-scripted", step, 16, eval_heldout=step == 5))
    assert np.isfinite(first["loss"]) and np.isfinite(last["heldout_action_mse"])
    assert last["heldout_action_mse"] < first["heldout_action_mse"]
    assert svc.action_chunks["pickcube-scripted"].targets(np.array([0]), np.array([0]), 4).shape == (1, 16)
