"""Security building blocks without a cluster: service-owned paths, quotas, tokens, certificates,
error classes and the actor memory estimate."""

from __future__ import annotations

import json
import os
import stat

import pytest

from nexus.config.paths import confine, private_write_bytes, resolve_output_dir
from nexus.config.service import ServiceConfig, ServiceLimits
from nexus.config.validation import (
    SIM_SEED_RANGE,
    check_eval_version,
    check_job_limits,
    check_new_tenant,
    validate_job,
    validate_tenant,
)
from nexus.errors import (
    Conflict,
    Forbidden,
    LimitExceeded,
    NexusError,
    NotFound,
    NotSupported,
    SpecError,
    Unauthorized,
    error_class,
)
from nexus.gateway.auth import TokenStore, read_operator_token
from nexus.spec import EvalJob, RLJob, SFTJob, TenantSpec

PUSH = {"name": "a", "env": "maniskill/pushcube-state"}


def test_gateway_and_validation_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, nexus.gateway.app, nexus.gateway.__main__, nexus.control.plugin, nexus.wire.inputs; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "NEXUS_SERVICE_CONFIG": "/nonexistent"})


# -- paths --------------------------------------------------------------------------------------
def test_output_dir_derived_from_name(tmp_path):
    tenants = tmp_path / "tenants"
    assert resolve_output_dir("a", None, tenants, None) == str(tenants / "a")
    assert resolve_output_dir("a", str(tenants / "a"), tenants, None) == str(tenants / "a")


@pytest.mark.parametrize("requested", ["/etc", "/tmp/elsewhere", "../b", "x/../../b", "relative"])
def test_output_dir_elsewhere_refused_without_base(tmp_path, requested):
    with pytest.raises(Forbidden, match="owned by the service"):
        resolve_output_dir("a", requested, tmp_path / "tenants", None)


def test_output_dir_confined_to_base_and_apart_from_other_tenants(tmp_path):
    base, tenants = tmp_path / "base", tmp_path / "root" / "tenants"
    assert resolve_output_dir("a", "mine", tenants, str(base)) == str(base / "mine")
    assert resolve_output_dir("a", str(base / "x" / "y"), tenants, str(base)) == str(base / "x" / "y")
    for bad in ("../escape", str(tmp_path / "other"), str(base), "/"):
        with pytest.raises(Forbidden, match="inside the output base"):
            resolve_output_dir("a", bad, tenants, str(base))
    others = [("b", str(base / "bdir"))]
    for bad in (str(base / "bdir"), str(base / "bdir" / "sub"), str(base)):
        with pytest.raises(Forbidden):
            resolve_output_dir("a", bad, tenants, str(base), others)
    with pytest.raises(Forbidden, match="overlaps"):  # a dir containing another tenant's
        resolve_output_dir("a", str(base / "outer"), tenants, str(base), [("b", str(base / "outer" / "b"))])
    with pytest.raises(Forbidden, match="tenants folder"):  # into the service's tenants folder, not its own
        resolve_output_dir("a", str(tenants / "b"), tenants, str(tmp_path))


def test_confine_refuses_symlinks_and_escapes(tmp_path):
    base = tmp_path / "base"
    (base / "a").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "f").write_text("x")
    assert confine(base / "a" / "new" / "deeper", base) == (base / "a" / "new" / "deeper")
    os.symlink(tmp_path / "secret", base / "a" / "link")
    with pytest.raises(Forbidden, match="symbolic link"):
        confine(base / "a" / "link" / "f", base)
    with pytest.raises(Forbidden, match="outside"):
        confine(tmp_path / "secret" / "f", base)
    with pytest.raises(NotFound):
        confine(base / "a" / "missing", base, must_exist=True)


def test_private_files_and_dirs(tmp_path):
    old = os.umask(0o022)  # even under a permissive umask
    try:
        private_write_bytes(tmp_path / "new" / "dir" / "f.json", b"{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "dir" / "f.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "dir").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700


# -- quotas -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, limit", [
    ("hidden_dim", 20000, "max_hidden_dim=4096"),
    ("seed", 10_000, "max_seed=600"),
    ("seed", 10**30, "max_seed=600"),
    ("max_inflight", 9, "max_inflight=8"),
    ("priority", -11, "max_priority=10"),
])
def test_tenant_limits_name_limit_and_value(field, value, limit):
    with pytest.raises(LimitExceeded) as e:
        validate_tenant({**PUSH, field: value}, ServiceLimits())
    assert limit in str(e.value) and str(abs(value)) in str(e.value)


def test_default_seed_limit_keeps_every_derived_seed_in_range():
    lim = ServiceLimits()
    assert lim.max_seed * 1_000_003 + 10**9 < SIM_SEED_RANGE  # RL: a billion episodes of headroom
    assert 7_000_003 * (1 + lim.max_seed) + lim.max_eval_episodes < SIM_SEED_RANGE


@pytest.mark.parametrize("job, limit", [
    (SFTJob(steps=100_001), "max_sft_steps"), (SFTJob(batch_size=4096), "max_batch_size"),
    (RLJob(updates=10**6), "max_rl_updates"), (RLJob(episodes_per_batch=65), "max_episodes_per_batch"),
    (RLJob(collectors=9), "max_collectors"), (RLJob(ppo={"update_epochs": 33}), "max_update_epochs"),
    (EvalJob(episodes=10**6), "max_eval_episodes"),
])
def test_job_limits(job, limit):
    with pytest.raises(LimitExceeded, match=limit):
        check_job_limits(job, ServiceLimits())


def test_concurrent_evals_tenants_and_pruned_versions():
    lim = ServiceLimits(max_concurrent_evals=2, max_tenants=3, max_versions_kept=5)
    check_job_limits(EvalJob(), lim, active_evals=1)
    with pytest.raises(LimitExceeded, match="max_concurrent_evals=2"):
        check_job_limits(EvalJob(), lim, active_evals=2)
    check_new_tenant(2, lim)
    with pytest.raises(LimitExceeded, match="max_tenants=3"):
        check_new_tenant(3, lim)
    check_eval_version("a", 6, 10, lim)
    with pytest.raises(NotFound, match="pruned"):
        check_eval_version("a", 5, 10, lim)
    with pytest.raises(NotFound, match="no version 11"):
        check_eval_version("a", 11, 10, lim)


def test_nan_and_inf_refused_in_specs_and_jobs():
    for field in ("init_log_std", "lr", "grad_clip"):
        for v in (float("nan"), float("inf")):
            with pytest.raises(SpecError, match=field):
                validate_tenant({**PUSH, field: v})
    spec, _ = validate_tenant(PUSH)
    with pytest.raises(SpecError, match="gamma"):
        validate_job(spec, {"kind": "rl", "ppo": {"gamma": float("nan")}})
    with pytest.raises(SpecError, match="expected a JSON object"):
        validate_job(spec, ["rl"])  # type: ignore[arg-type]


def test_per_tenant_overrides():
    cfg = ServiceConfig(root="/tmp/x", tenant_limits={"big": {"max_hidden_dim": 100_000}})
    assert cfg.limits_for("big").max_hidden_dim == 100_000 and cfg.limits_for("other").max_hidden_dim == 4096
    with pytest.raises(ValueError):
        ServiceConfig(root="/tmp/x", tenant_limits={"t": {"no_such_limit": 1}})


# -- tokens -------------------------------------------------------------------------------------
def test_token_store_keeps_hashes_only(tmp_path):
    store = TokenStore(tmp_path / "gw")
    ta, tb = store.issue("a", PUSH), store.issue("b", {**PUSH, "name": "b"})
    text = (tmp_path / "gw" / "tokens.json").read_text()
    assert ta not in text and tb not in text and ta[4:] not in text
    for f in ("tokens.json", "operator.token"):
        assert stat.S_IMODE(os.stat(tmp_path / "gw" / f).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "gw").st_mode) == 0o700
    assert store.identify(ta).tenant == "a" and store.identify(tb).tenant == "b"
    old_operator = read_operator_token(tmp_path / "gw")
    op = store.identify(old_operator)
    assert op.operator and op.tenant is None
    for bad in (None, "", "nxt_guess", ta + "x", ta[:-1]):
        with pytest.raises(Unauthorized):
            store.identify(bad)
    store.identify(ta).may_act_on("a")
    with pytest.raises(Forbidden):
        store.identify(ta).may_act_on("b")
    with pytest.raises(Forbidden, match="operator"):
        store.identify(ta).require_operator("scaling")
    # persisted: a restarted gateway knows the tenants, and issues a fresh operator token
    again = TokenStore(tmp_path / "gw")
    assert again.identify(ta).tenant == "a" and json.loads(text)["tenants"]["a"]["spec"] == PUSH
    assert again.identify(read_operator_token(tmp_path / "gw")).operator
    with pytest.raises(Unauthorized):
        again.identify(old_operator)
    again.revoke("a")
    with pytest.raises(Unauthorized):
        TokenStore(tmp_path / "gw").identify(ta)


# -- errors -------------------------------------------------------------------------------------
def test_every_error_class_has_a_status_and_survives_by_name():
    seen = {}
    for cls in (SpecError, LimitExceeded, NotFound, Conflict, Unauthorized, Forbidden, NotSupported):
        assert issubclass(cls, NexusError) and 400 <= cls.http_status < 600
        assert error_class(cls.__name__) is cls
        seen[cls.__name__] = cls.http_status
    assert seen["Unauthorized"] == 401 and seen["Forbidden"] == 403 and seen["NotFound"] == 404
    assert error_class("KeyboardInterrupt") is NexusError and error_class("nope") is NexusError
    assert str(NotFound("unknown tenant 'x'")) == "unknown tenant 'x'"  # not KeyError's quoting


# -- certificates -------------------------------------------------------------------------------
def test_certificates_generated_private_and_verifiable(tmp_path):
    import ssl

    from nexus.deploy.tls import ensure_certificates, security

    files = ensure_certificates(tmp_path / "tls")
    for p in (files.key, files.cert, files.ca, tmp_path / "tls" / "ca.key"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    ctx = ssl.create_default_context(cafile=str(files.ca))
    ctx.load_cert_chain(str(files.cert), str(files.key))  # the key matches the certificate
    assert ensure_certificates(tmp_path / "tls").cert.read_bytes() == files.cert.read_bytes()  # kept
    sec = security(ServiceConfig(root=str(tmp_path), tls=True))
    assert sec.require_encryption and sec.tls_ca_file == str(tmp_path / "tls" / "ca.pem")
    assert security(ServiceConfig(root=str(tmp_path))) is None


# -- actor memory estimate ----------------------------------------------------------------------
@pytest.mark.parametrize("family, hidden", [("oft", 256), ("oft", 20000), ("groot", 512), ("pi", 256)])
def test_slot_estimate_counts_real_parameters_without_allocating(family, hidden):
    import torch

    from nexus.actor.slots import ACTOR_BYTES_PER_PARAM, slot_bytes
    from nexus.features import TenantSchema
    from nexus.model.policy import TenantPolicy

    spec = TenantSpec(name="a", env="maniskill/pushcube-state", action_head=family, hidden_dim=hidden)
    schema = TenantSchema(35, 4)
    est = slot_bytes(spec, schema, 64)
    if hidden <= 512:  # a real build has exactly that many parameters
        real = sum(p.numel() for p in TenantPolicy.from_spec(spec, schema, 64).parameters())
        assert est == ACTOR_BYTES_PER_PARAM * real
    else:  # 1.2e9 parameters: counted on the meta device in no time and no memory
        assert est > 30 * 2**30
    assert torch.get_default_device().type == "cpu"  # the meta context did not leak


def test_slot_estimate_counts_the_lora_adapter():
    from nexus.actor.slots import ACTOR_BYTES_PER_PARAM, slot_bytes
    from nexus.features import TenantSchema
    from nexus.model.backbone import BackboneConfig, SharedBackbone
    from nexus.model.policy import TenantPolicy
    from nexus.spec import LoraConfig

    bb = SharedBackbone(BackboneConfig(size="tiny", image_size=64))
    spec = TenantSpec(name="a", env="maniskill/pushcube-state", hidden_dim=32, lora=LoraConfig(rank=8))
    schema, shapes = TenantSchema(35, 4), bb.lora_shapes(spec.lora)
    real = sum(p.numel() for p in TenantPolicy.from_spec(spec, schema, bb.hidden_size, lora_shapes=shapes).parameters())
    assert slot_bytes(spec, schema, bb.hidden_size, shapes) == ACTOR_BYTES_PER_PARAM * real
    heads_only = spec.model_copy(update={"lora": None})
    assert slot_bytes(spec, schema, bb.hidden_size, shapes) > slot_bytes(heads_only, schema, bb.hidden_size)


# -- export targets and init_from through the gateway ---------------------------------------------
def test_export_target_confined_to_the_tenants_output_dir(tmp_path):
    from nexus.gateway.app import export_target

    out = tmp_path / "tenants" / "a"
    (out / "exports").mkdir(parents=True)
    (tmp_path / "tenants" / "b").mkdir()
    assert export_target("exports/mine", str(out), operator=False) == str(out / "exports" / "mine")
    assert export_target(str(out / "exports" / "x"), str(out), operator=False) == str(out / "exports" / "x")
    os.symlink(tmp_path / "tenants" / "b", out / "exports" / "to-b")
    for bad in ("/etc/evil", str(tmp_path / "tenants" / "b" / "x"), "../b/x", "exports/../../b", "exports/to-b/x",
                str(out), ".", "weights/v9", "checkpoints/x", "jobs/j", "manifest.json"):
        with pytest.raises(Forbidden):
            export_target(bad, str(out), operator=False)
    with pytest.raises(SpecError):
        export_target("a\x00b", str(out), operator=False)
    # the operator may name any server path; relative ones are still inside the output dir
    assert export_target("/srv/exports/a", str(out), operator=True) == "/srv/exports/a"
    assert export_target("exports/y", str(out), operator=True) == str(out / "exports" / "y")


def test_init_from_needs_an_export_in_the_callers_own_dir(tmp_path):
    from nexus.gateway.app import init_from_allowed

    own, other = tmp_path / "a", tmp_path / "b"
    (own / "exports" / "v000001").mkdir(parents=True)
    (other / "exports" / "v000001").mkdir(parents=True)
    init_from_allowed(str(own / "exports" / "v000001"), str(own))
    os.symlink(other / "exports" / "v000001", own / "exports" / "link")
    for path, own_dir in [(str(other / "exports" / "v000001"), str(own)), (str(own / "exports" / "v000001"), None),
                          ("exports/v000001", str(own)), (str(own / "exports" / "link"), str(own)),
                          (str(own / "exports" / ".." / ".." / "b" / "exports" / "v000001"), str(own)),
                          (str(own / "exports" / "missing"), str(own))]:
        with pytest.raises(Forbidden):
            init_from_allowed(path, own_dir)
