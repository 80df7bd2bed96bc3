"""The `medium` backbone (Qwen3-VL, 1024 wide, 12 layers, 250 M parameters) end to end from a saved checkpoint:
saved as a Hugging Face checkpoint directory, loaded by ``from_pretrained`` (``backbone.local_path``) on the
actor and on an inference engine, a LoRA r = 8 tenant SFT-trained on a two-camera dataset for two steps, its
actions predicted by the engine, exported, and the export loaded without a service and acting the same.

Every headline figure so far ran on `tiny` (64 wide); this keeps the path working at a real width. Bounded:
two SFT steps of 4 samples, one predict, one export load. No cluster: the actor-side tasks and a real inference
engine run in this process, as in tests/test_export.py.
"""

from __future__ import annotations

import gc
import json

import numpy as np
import torch

from nexus.actor import tasks as actor_tasks
from nexus.actor.export import export_version
from nexus.actor.host import ActorHost
from nexus.config import catalog
from nexus.config.service import ServiceConfig
from nexus.data.output_dir import TenantOutputDir
from nexus.data.trajectory_store import arrays_to_observations
from nexus.engine.engine import InferenceEngine, _Request
from nexus.export import policy as exported
from nexus.model.backbone import BackboneConfig, SharedBackbone
from nexus.spec import LoraConfig, TenantSpec
from nexus.wire.messages import SFTWork, TenantSetup, UpdateRequest
from tests.checkpoints import save_hf_checkpoint
from tests.test_export import SyncEngine

torch.set_num_threads(1)

DATASET = "robosuite-lift-scripted"  # agent-view + wrist cameras (64 px), 8-D state, 7-D actions
SCHEMA = catalog.dataset(DATASET).schema
SPEC = TenantSpec(name="medium-lora", dataset=DATASET, hidden_dim=32, lr=3e-3, seed=5, lora=LoraConfig(rank=8))
STEPS, BATCH = 2, 4


def test_medium_checkpoint_sft_predict_export_and_load(tmp_path):
    assert len(SCHEMA.cameras) == 2  # the vision tower runs, not only the decoder
    offline = SharedBackbone(BackboneConfig(size="medium", image_size=64))
    assert (offline.hidden_size, offline.num_hidden_states) == (1024, 13)
    ckpt = save_hf_checkpoint(offline, tmp_path / "ckpt")
    fingerprint = offline.fingerprint()
    del offline
    gc.collect()

    cfg = ServiceConfig(root=str(tmp_path / "svc"), backbone={"local_path": str(ckpt), "image_size": 64})
    actor = ActorHost(cfg)  # this process plays the actor rank: from_pretrained of the saved checkpoint
    backbone = actor.framework.backbone
    assert backbone.fingerprint() == fingerprint, "the checkpoint loads the very weights that were saved"
    engine = InferenceEngine(cfg)
    sync = SyncEngine(engine)
    out = str(cfg.tenants_dir / SPEC.name)
    setup = TenantSetup(SPEC.name, SPEC, SCHEMA, out)
    info = actor_tasks.init_tenant(actor, setup)
    sync.register_tenant(SPEC, SCHEMA, info.version, TenantOutputDir(out).weights_path(info.version).read_bytes()
                         ).result()
    lora_before = {k: v.clone() for k, v in actor.slot(SPEC.name).policy.state_dict().items() if k.startswith("lora.")}
    assert len(lora_before) == 2 * 2 * 12  # A and B of q_proj and v_proj in each of the 12 layers

    for step in range(STEPS):
        actor_tasks.update(actor, UpdateRequest(f"medium-{step}", None, SFTWork(DATASET, step, BATCH), setup, ()),
                           sync)
    lora_after = actor.slot(SPEC.name).policy.state_dict()
    assert any(not torch.equal(lora_after[k], v) for k, v in lora_before.items()), "SFT did not move the adapter"
    assert backbone.fingerprint() == fingerprint, "SFT changed the shared backbone"

    held = actor.dataset(DATASET).heldout()
    obs = arrays_to_observations({k: v[:3] for k, v in held.items()}, SCHEMA)
    assert obs[0].images and next(iter(obs[0].images.values())).shape == (64, 64, 3)
    want = engine._forward([_Request(SPEC.name, o, None, True, job=None) for o in obs])
    assert [w["version"] for w in want] == [STEPS] * len(obs)
    assert all(w["action"].shape == (SCHEMA.action_dim,) and np.isfinite(w["action"]).all() for w in want)

    path = export_version(actor, setup, STEPS, str(tmp_path / "export"))["path"]
    ref = json.loads((tmp_path / "export" / "backbone.json").read_text())
    assert ref["source"] == "checkpoint" and ref["local_path"] == str(ckpt.resolve())
    assert ref["weights_sha256"] == fingerprint
    loaded = exported.load(path)  # no service: the policy dir and the checkpoint it names
    got = loaded.predict_actions(obs)
    for g, w in zip(got, want, strict=True):
        assert g["version"] == w["version"] == STEPS
        np.testing.assert_allclose(g["action"], w["action"], atol=1e-4)
