"""Exported policies: the worker-side export of a tenant output dir's version, ``nexus.export.policy.load`` without a
service, ``init_from``, the MLflow pyfunc wrapper (``mlflow models predict``), backbone checkpoint dirs.

No cluster: the real actor-side tasks (``nexus.actor.tasks`` on an ``ActorHost``) and a real
``InferenceEngine`` run in this process (the engine's coroutines driven synchronously, as the actor proxy would).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from nexus.actor import ops
from nexus.actor import tasks as actor_tasks
from nexus.actor.export import export_version
from nexus.actor.host import ActorHost
from nexus.config import catalog
from nexus.config.service import ServiceConfig
from nexus.data.output_dir import TenantOutputDir
from nexus.data.trajectory_store import arrays_to_observations
from nexus.engine.engine import InferenceEngine, _Request
from nexus.engine.host import EngineHost
from nexus.errors import Conflict, NotFound, SpecError
from nexus.export import policy as exported
from nexus.spec import LoraConfig, TenantSpec
from nexus.wire.messages import OpWork, SFTWork, SlotInfo, TenantSetup, UpdateRequest
from tests.checkpoints import save_hf_checkpoint

torch.set_num_threads(1)

DATASET = "pickcube-scripted"
SCHEMA = catalog.dataset(DATASET).schema
LORA = TenantSpec(name="pick-lora", dataset=DATASET, hidden_dim=32, lr=3e-3, seed=3,
                  lora=LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj")))
GROOT = TenantSpec(name="pick-groot", dataset=DATASET, hidden_dim=32, lr=3e-3, seed=4, action_head="groot", chunk=4)
STEPS = 3


class SyncEngine:
    """The real InferenceEngine, its coroutines run to completion per call (what ``.result()`` gives); as
    the actor's ``EngineSet`` of one engine, it records the pushes it took."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.pushed_to: list[str] = []
        self.errors: list[str] = []

    def __getattr__(self, name: str):
        def call(*args, **kwargs) -> Future:
            fut: Future = Future()
            fut.set_result(asyncio.run(getattr(self.engine, name)(*args, **kwargs)))
            return fut

        return call


def init_tenant(actor: ActorHost, spec: TenantSpec, output_dir, engine: InferenceEngine) -> SlotInfo:
    """The actor's slot build (``actor_tasks.init_tenant``), then the tenant registered on the engine from its
    durable version-0 weights, as the engine pool does."""
    info = actor_tasks.init_tenant(actor, TenantSetup(spec.name, spec, SCHEMA, str(output_dir)))
    weights = TenantOutputDir(output_dir).weights_path(info.version).read_bytes()
    SyncEngine(engine).register_tenant(spec, SCHEMA, info.version, weights).result()
    return info


def setup(spec: TenantSpec, output_dir, version: int = 0) -> TenantSetup:
    return TenantSetup(spec.name, spec, SCHEMA, str(output_dir), version)


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    """An actor rank's ActorHost and an InferenceEngine with two trained tenants (versions 0..3)."""
    root = tmp_path_factory.mktemp("svc")
    cfg = ServiceConfig(root=str(root), backbone={"size": "tiny", "image_size": 64})
    service = ActorHost(cfg)  # this process plays the actor rank (no Dask worker)
    engine = InferenceEngine(cfg)
    sync = SyncEngine(engine)
    outs = {}
    for spec in (LORA, GROOT):
        out = str(cfg.tenants_dir / spec.name)
        init_tenant(service, spec, out, engine)
        for step in range(STEPS):
            req = UpdateRequest(f"{spec.name}-{step}", None, SFTWork(DATASET, step, 16), setup(spec, out), ())
            actor_tasks.update(service, req, sync)
        outs[spec.name] = out
    yield service, engine, outs


def heldout_observations(service, n: int = 5) -> list:
    ds = service.dataset(DATASET)
    held = ds.heldout()
    return arrays_to_observations({k: v[:n] for k, v in held.items()}, SCHEMA)


def engine_actions(engine: InferenceEngine, tenant: str, observations: list, version: int | None = None) -> list:
    """What the service's inference engine answers (one grouped forward, deterministic)."""
    return engine._forward([_Request(tenant, o, version, True, job=None)
                            for o in observations])


def test_export_writes_the_documented_directory(svc, tmp_path):
    service, _, outs = svc
    info = export_version(service, setup(LORA, outs[LORA.name]), STEPS, str(tmp_path / "p"))
    d = Path(info["path"])
    listing = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert listing == ["README.md", "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                       "backbone.json", "head.safetensors", "manifest.json", "normalization.json", "preprocessor.json"]
    assert sorted(info["files"]) == listing
    m = exported.read_manifest(d)
    assert (m["tenant"], m["version"], m["action_head"]) == (LORA.name, STEPS, "oft")
    assert m["backbone"]["weights_sha256"] == service.framework.backbone.fingerprint()
    ref = json.loads((d / "backbone.json").read_text())
    assert ref["source"] == "offline-preset" and ref["hf_config"]["model_type"] == "qwen3_vl"
    # weights are this version's durable file, split into head and peft adapter
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import load_file

    state = torch.load(TenantOutputDir(outs[LORA.name]).weights_path(STEPS), weights_only=True)
    head = load_file(str(d / "head.safetensors"))
    assert set(head) == {k for k in state if not k.startswith("lora.")}
    assert all(torch.equal(head[k], state[k]) for k in head)
    adapter = load_file(str(d / "adapter/adapter_model.safetensors"))
    assert len(adapter) == sum(1 for k in state if k.startswith("lora."))  # A and B of each projection
    assert all(k.startswith("base_model.model.language_model.layers.") for k in adapter)
    assert PeftLoraConfig.from_pretrained(str(d / "adapter")).r == 4
    # normalization: the SFT dataset's action statistics
    stats = json.loads((d / "normalization.json").read_text())["action_stats"]
    train_actions = service.dataset(DATASET).train()["action"]
    assert stats["rows"] == len(train_actions) and stats["source"] == f"dataset:{DATASET}"
    np.testing.assert_allclose(stats["mean"], train_actions.mean(0), atol=1e-5)
    pre = json.loads((d / "preprocessor.json").read_text())
    assert pre["schema"]["proprio_dim"] == SCHEMA.proprio_dim and pre["image_size"] == 64


@pytest.mark.parametrize("spec", [LORA, GROOT], ids=["oft-lora", "groot-chunk"])
def test_exported_policy_acts_like_the_service(svc, tmp_path, spec):
    """Round trip: the loaded directory's actions == the inference engine's, for the same observations."""
    service, engine, outs = svc
    path = tmp_path / spec.name
    export_version(service, setup(spec, outs[spec.name]), STEPS, str(path))
    loaded = exported.load(path)
    obs = heldout_observations(service)
    want = engine_actions(engine, spec.name, obs)
    got = loaded.predict_actions(obs)
    one = loaded.predict_action({"state": obs[0].state})
    for w, g in zip(want, got, strict=True):
        assert g["version"] == w["version"] == STEPS
        np.testing.assert_allclose(g["action"], w["action"], atol=1e-5)
        if spec.chunk > 1:
            assert g["chunk"].shape == (spec.chunk * SCHEMA.action_dim,)
            np.testing.assert_allclose(g["chunk"], w["chunk"], atol=1e-5)
    np.testing.assert_allclose(one["action"], want[0]["action"], atol=1e-5)
    if spec.lora is not None:  # the adapter matters: without it the same head acts differently
        loaded.policy.lora = None
        bare = loaded.predict_actions(obs)
        assert max(np.abs(b["action"] - w["action"]).max() for b, w in zip(bare, want, strict=True)) > 1e-5


def test_an_older_version_exports_its_own_weights(svc, tmp_path):
    service, engine, outs = svc
    path = tmp_path / "v1"
    export_version(service, setup(LORA, outs[LORA.name]), 1, str(path))
    v1 = exported.load(path)
    assert v1.version == 1
    state = torch.load(TenantOutputDir(outs[LORA.name]).weights_path(1), weights_only=True)
    for k, v in v1.policy.state_dict().items():
        assert torch.equal(v, state[k]), k
    v3 = exported.load(export_version(service, setup(LORA, outs[LORA.name]), 3, str(tmp_path / "v3"))["path"])
    obs = heldout_observations(svc[0], 2)
    assert np.abs(v1.predict_action(obs[0])["action"] - v3.predict_action(obs[0])["action"]).max() > 1e-6


def test_an_export_without_a_path_lands_in_the_output_dir_once(svc, monkeypatch):
    """No path: ``<output dir>/exports/vNNNNNN/`` (what the gateway serves as the tenant's files), written once
    and reused; only actor rank 0 writes."""
    service, _, outs = svc
    args = (service, setup(LORA, outs[LORA.name]), 2)
    with monkeypatch.context() as m:
        m.setattr(service, "rank", 1)
        assert actor_tasks.export_version(*args) == {}
    assert not (Path(outs[LORA.name]) / "exports" / "v000002").exists()
    info = actor_tasks.export_version(*args)
    target = Path(outs[LORA.name]) / "exports" / "v000002"
    assert info["path"] == str(target.resolve()) and info["relative_path"] == "exports/v000002"
    created = exported.read_manifest(target)["created"]
    again = export_version(*args)
    assert again == info and exported.read_manifest(target)["created"] == created  # not rewritten
    assert exported.load(target).version == 2
    outside = export_version(*args[:2], 1, str(Path(outs[LORA.name]).parent.parent / "elsewhere-v1"))
    assert outside["relative_path"] is None


def test_a_rebuilt_engine_restores_lora_adapters_from_durable_weights(svc):
    """An engine of the pool that starts fresh (a crash, a scale-up) is synced from the output dirs' weights
    files (``EngineHost.sync`` with TenantSetup, as the pool sends it): every version's file carries the
    adapter, so the new engine answers what the original one does, for the live version and a pinned one."""
    service, engine, outs = svc
    host = EngineHost("engine-9.1", engine.config, deque())
    setups = [setup(s, outs[s.name], STEPS) for s in (LORA, GROOT)]
    asyncio.run(host.sync(setups, [[LORA.name, 1, outs[LORA.name], 1]]))
    assert host.engine.versions()["live"] == {LORA.name: STEPS, GROOT.name: STEPS}
    state = torch.load(TenantOutputDir(outs[LORA.name]).weights_path(STEPS), weights_only=True)
    assert any(k.startswith("lora.") for k in state)  # the weights file carries the adapter
    obs = heldout_observations(service, 3)
    for tenant, version in ((LORA.name, None), (GROOT.name, None), (LORA.name, 1)):
        if version is not None:
            asyncio.run(engine.pin(tenant, version, outs[tenant]))
        want = np.stack([o["action"] for o in engine_actions(engine, tenant, obs, version)])
        got = np.stack([o["action"] for o in engine_actions(host.engine, tenant, obs, version)])
        np.testing.assert_allclose(got, want, atol=1e-5)
    v1 = np.stack([o["action"] for o in engine_actions(host.engine, LORA.name, obs, 1)])
    live = np.stack([o["action"] for o in engine_actions(host.engine, LORA.name, obs)])
    assert np.abs(v1 - live).max() > 1e-6  # the pin runs version 1's own adapter, not the live one
    # and the adapter matters: without it (zeroed lora_B) the same head answers differently
    bare = {k: (torch.zeros_like(v) if ".lora_B." in k else v) for k, v in state.items()}
    host.engine.heads.live[LORA.name] = (STEPS, host.engine.heads.policy_from_bytes(LORA.name, _bytes(bare)))
    without = np.stack([o["action"] for o in engine_actions(host.engine, LORA.name, obs)])
    assert np.abs(without - live).max() > 1e-5
    asyncio.run(host.stop())


def _bytes(state: dict) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def test_bad_exports_and_bad_directories_are_refused(svc, tmp_path, tiny_paligemma):
    service, _, outs = svc
    args = (service, setup(LORA, outs[LORA.name]))
    with pytest.raises(NotFound, match="version 99"):
        export_version(*args, 99, str(tmp_path / "nope"))
    assert not (tmp_path / "nope").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(Conflict, match="not an empty directory"):
        export_version(*args, 1, str(busy))
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary directory left behind"
    with pytest.raises(NotFound, match="not an exported policy"):
        exported.load(tmp_path / "missing")

    good = Path(export_version(*args, 2, str(tmp_path / "good"))["path"])
    tampered = tmp_path / "tampered"
    shutil.copytree(good, tampered)
    head = (tampered / "head.safetensors").read_bytes()
    (tampered / "head.safetensors").write_bytes(head[:-4] + bytes(4))
    with pytest.raises(SpecError, match="sha256"):
        exported.load(tampered)
    # a policy trained on other backbone weights cannot seed a tenant on this one
    with pytest.raises(SpecError, match="backbone weights"):
        exported.initial_state(good, LORA, SCHEMA, tiny_paligemma)


def test_init_from_an_exported_policy(svc, tmp_path):
    service, engine, outs = svc
    lora_dir = Path(export_version(service, setup(LORA, outs[LORA.name]), STEPS, str(tmp_path / "lora"))["path"])
    groot_dir = Path(export_version(service, setup(GROOT, outs[GROOT.name]), STEPS, str(tmp_path / "groot"))["path"])
    bb = service.framework.backbone
    obs = heldout_observations(service, 3)

    # a new tenant (new name, seed, output dir) through the actor's init: version 0 is the exported policy
    spec = LORA.model_copy(update={"name": "pick-lora-2", "seed": 99, "init_from": str(lora_dir)})
    out = service.config.tenants_dir / "pick-lora-2"
    info = init_tenant(service, spec, out, engine)
    assert info.version == 0 and not info.restored
    want = [o["action"] for o in exported.load(lora_dir).predict_actions(obs)]
    got = [o["action"] for o in engine_actions(engine, spec.name, obs)]
    np.testing.assert_allclose(np.stack(got), np.stack(want), atol=1e-5)
    assert service.slots[spec.name].version == 0

    # a LoRA tenant may start from a heads-only export: exported head, fresh (no-op) adapter
    groot_lora = GROOT.model_copy(update={"name": "g2", "lora": LoraConfig(rank=2), "init_from": str(groot_dir)})
    state = exported.initial_state(groot_dir, groot_lora, SCHEMA, bb)
    assert not any(v.any() for k, v in state.items() if k.startswith("lora.") and ".lora_B." in k)
    head = exported.load(groot_dir).policy.state_dict()
    assert all(torch.equal(state[k], v) for k, v in head.items())

    # refusals name the mismatch, and nothing is created
    for bad, match in [(LORA.model_copy(update={"lora": None}), "carries a LoRA adapter"),
                       (LORA.model_copy(update={"lora": LoraConfig(rank=8)}), "does not fit the spec's lora"),
                       (LORA.model_copy(update={"hidden_dim": 64}), "head weights do not fit"),
                       (LORA.model_copy(update={"action_head": "groot", "hidden_dim": 32}), "action head")]:
        with pytest.raises(SpecError, match=match):
            exported.initial_state(lora_dir, bad, SCHEMA, bb)
    bad_out = service.config.tenants_dir / "bad"
    bad = LORA.model_copy(update={"name": "bad", "lora": None, "init_from": str(lora_dir)})
    with pytest.raises(SpecError):
        init_tenant(service, bad, bad_out, engine)
    assert not bad_out.exists() and "bad" not in service.slots


def test_mlflow_pyfunc_model_and_mlflow_models_predict(svc, tmp_path):
    """The directory as an MLflow model: ``mlflow.pyfunc.load_model`` and the ``mlflow models predict`` CLI."""
    import mlflow

    from nexus.export.mlflow_model import save_policy_model

    service, engine, outs = svc
    d = export_version(service, setup(LORA, outs[LORA.name]), STEPS, str(tmp_path / "p"))["path"]
    model_dir = save_policy_model(d, tmp_path / "mlmodel")
    assert (Path(model_dir) / "MLmodel").is_file() and (Path(model_dir) / "code" / "nexus").is_dir()
    obs = heldout_observations(service, 3)
    want = np.stack([o["action"] for o in engine_actions(engine, LORA.name, obs)])
    model = mlflow.pyfunc.load_model(model_dir)
    got = model.predict({"state": np.stack([o.state for o in obs])})
    assert got.shape == (3, SCHEMA.action_dim)
    np.testing.assert_allclose(got, want, atol=1e-5)

    inp = tmp_path / "input.json"
    inp.write_text(json.dumps({"inputs": {"state": [o.state.tolist() for o in obs]}}))
    result = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}  # the model's own code copy only
    subprocess.run([str(Path(sys.executable).with_name("mlflow")), "models", "predict", "-m", model_dir,
                    "-i", str(inp), "-t", "json", "-o", str(result), "--env-manager", "local"],
                   check=True, env=env, cwd=tmp_path, capture_output=True, timeout=300)
    preds = np.asarray(json.loads(result.read_text())["predictions"], dtype=np.float32)
    np.testing.assert_allclose(preds, want, atol=1e-5)


def test_backbone_checkpoint_dirs_in_config_and_exports(tiny_backbone, tmp_path, monkeypatch):
    """``backbone.local_path`` (service config / CLI) takes a Hugging Face checkpoint directory; an export
    made on it names the checkpoint and loads from where it lives now."""
    from nexus.model.backbone import SharedBackbone
    from nexus.model.policy import TenantPolicy

    ckpt = save_hf_checkpoint(tiny_backbone, tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    cfg = ServiceConfig(root=str(tmp_path / "svc"), backbone={"local_path": "ckpt"})
    assert cfg.backbone.local_path == str(ckpt.resolve())  # service processes run in another cwd
    with pytest.raises(ValueError, match="no config.json"):
        ServiceConfig(root="x", backbone={"local_path": str(tmp_path)})
    with pytest.raises(ValueError, match="not a 'paligemma' backbone"):
        ServiceConfig(root="x", backbone={"local_path": str(ckpt), "family": "paligemma"})

    from nexus.client.cli import _with_backbone, main  # the CLI's --backbone-path ends in the same config

    ns = argparse.Namespace(backbone_path=str(ckpt), backbone_family=None, backbone_size=None, image_size=None)
    assert _with_backbone(ServiceConfig(root="x"), ns).backbone.local_path == str(ckpt)
    with pytest.raises(SystemExit):
        main(["up", "--backbone-family", "nope"])

    bb = SharedBackbone(cfg.backbone)
    assert bb.fingerprint() == tiny_backbone.fingerprint()  # the same weights, whatever their source
    spec = LORA.model_copy(update={"name": "ck"})
    policy = TenantPolicy.from_spec(spec, SCHEMA, bb.hidden_size, lora_shapes=bb.lora_shapes(spec.lora))
    d = tmp_path / "policy"
    exported.write(d, spec=spec, schema=SCHEMA, version=0, state_dict=policy.state_dict(), backbone=bb)
    ref = json.loads((d / "backbone.json").read_text())
    assert ref["source"] == "checkpoint" and ref["local_path"] == str(ckpt.resolve())
    assert exported.load(d).backbone.cfg.local_path == str(ckpt.resolve())
    moved = tmp_path / "moved"
    ckpt.rename(moved)
    with pytest.raises(NotFound, match="backbone_path"):
        exported.load(d)
    assert exported.load(d, backbone_path=str(moved)).backbone.fingerprint() == ref["weights_sha256"]


def test_low_level_ops_train_a_lora_tenant_through_the_backbone(svc, tmp_path):
    """Tinker-style ``forward_backward`` (sft and ppo losses) + ``optim_step`` on the actor for a LoRA tenant:
    the adapter moves, the shared backbone does not."""
    service, engine, _ = svc
    spec = LORA.model_copy(update={"name": "ops-lora", "seed": 8})
    out = service.config.tenants_dir / "ops-lora"
    init_tenant(service, spec, out, engine)
    slot = service.slots[spec.name]
    base = {k: v.clone() for k, v in service.framework.backbone.model.state_dict().items()}
    adapter0 = {k: v.clone() for k, v in slot.policy.state_dict().items() if k.startswith("lora.")}
    obs = heldout_observations(service, 6)
    actions = np.random.default_rng(0).normal(size=(6, SCHEMA.action_dim)).astype(np.float32)
    data = {"observations": obs, "actions": actions, "logprobs": np.zeros(6, np.float32),
            "advantages": np.linspace(-1, 1, 6).astype(np.float32), "returns": np.ones(6, np.float32)}
    fields = {"sft": ("observations", "actions"), "ppo": tuple(data)}  # each loss takes its own fields only
    for loss in ("sft", "ppo"):
        batch = {k: data[k] for k in fields[loss]}
        _, metrics, _ = ops.run_op(service, slot, OpWork("forward_backward", loss), batch, None, None)
        assert np.isfinite(metrics["loss"])
        ops.run_op(service, slot, OpWork("optim_step"), None, None, None)
    now = slot.policy.state_dict()
    assert any(not torch.equal(now[k], v) for k, v in adapter0.items())
    assert all(torch.equal(v, base[k]) for k, v in service.framework.backbone.model.state_dict().items())
