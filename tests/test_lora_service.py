"""The whole path on a real local cluster: a service on a Hugging Face backbone checkpoint (saved here) with
two inference engines, LoRA and plain tenants trained side by side (every engine answering with the tenant's
adapter), ``tenant.export`` / ``nexus export`` through the gateway (written into the tenant's output dir,
downloaded; server paths confined for tenant tokens), the exported policy loaded without the service (same
actions), the job's MLflow model, and ``init_from``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.config import catalog
from nexus.data.offline_dataset import OfflineDataset
from nexus.data.trajectory_store import arrays_to_observations
from nexus.errors import Conflict, Forbidden, NotFound
from nexus.spec import LoraConfig, TenantSpec

pytestmark = pytest.mark.cluster

DATASET = "pickcube-scripted"
LORA = TenantSpec(name="pick-lora", dataset=DATASET, hidden_dim=32, lr=3e-3, seed=21,
                  lora=LoraConfig(rank=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")))
PLAIN = TenantSpec(name="pick-plain", dataset=DATASET, hidden_dim=32, lr=3e-3, seed=22)
STEPS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A Qwen3-VL checkpoint directory as the hub lays it out (conditional-generation weights + tokenizer
    + image processor): the tiny offline model's weights, saved with save_pretrained."""
    import torch

    from nexus.model.backbone import BackboneConfig, SharedBackbone
    from tests.checkpoints import save_hf_checkpoint

    torch.set_num_threads(1)
    return save_hf_checkpoint(SharedBackbone(BackboneConfig(size="tiny", image_size=64)),
                              tmp_path_factory.mktemp("qwen3vl-checkpoint"))


@pytest.fixture(scope="module")
def nx(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("lora-service")
    with Nexus.local(root, n_sim=1, n_infer=2, inference_engines=2, backbone={"local_path": str(checkpoint)}) as nexus:
        yield nexus


@pytest.fixture(scope="module")
def trained(nx):
    lora, plain = nx.create_tenant(LORA), nx.create_tenant(PLAIN)
    jobs = [lora.sft(steps=STEPS, batch_size=16), plain.sft(steps=STEPS, batch_size=16)]  # side by side
    return lora, plain, [j.result(timeout=600) for j in jobs]


def heldout(n: int = 4) -> list:
    held = OfflineDataset(catalog.dataset(DATASET)).heldout()
    return arrays_to_observations({k: v[:n] for k, v in held.items()}, catalog.dataset(DATASET).schema)


def service_actions(tenant, observations) -> np.ndarray:
    return np.stack([tenant.predict_action(o, deterministic=True).result()["action"] for o in observations])


def test_lora_and_plain_tenants_train_on_a_checkpoint_backbone(nx, trained, checkpoint):
    _, _, results = trained
    assert nx.status()["config"]["backbone"]["local_path"] == str(checkpoint.resolve())
    for res in results:
        assert res["version"] == STEPS and np.isfinite(res["heldout_action_mse"])
    logs = {t: nx.tenant_log(t)["jobs"][0]["history"] for t in (LORA.name, PLAIN.name)}
    for history in logs.values():
        mse = [h["heldout_action_mse"] for h in history if "heldout_action_mse" in h]
        assert mse[-1] < mse[0]


def test_every_engine_of_the_pool_serves_the_adapter(nx, trained):
    """Both engines registered the LoRA tenant (TenantSetup + its weights file) and answer alike; the
    adapter changes the answer (the two tenants share the backbone and differ in head and adapter)."""
    lora, plain, _ = trained
    obs = heldout(3)
    assert len(nx.service.internal("nexus_engines")) == 2
    per_engine = [np.stack([nx.service.engine(i).predict(LORA.name, o, None, True).result()["action"] for o in obs])
                  for i in range(2)]
    np.testing.assert_allclose(per_engine[0], per_engine[1], atol=1e-5)
    np.testing.assert_allclose(per_engine[0], service_actions(lora, obs), atol=1e-5)
    versions = [nx.service.engine(i).versions().result()["live"] for i in range(2)]
    assert all(v[LORA.name] == STEPS and v[PLAIN.name] == STEPS for v in versions)


def test_export_round_trip_api_and_cli(nx, trained, tmp_path, capsys):
    """``tenant.export`` and ``nexus export`` write the directory; loaded without the service it answers
    what the service answers."""
    import nexus.export.policy
    from nexus.client.cli import main

    lora, plain, _ = trained
    obs = heldout()
    a = lora.export(None, tmp_path / "api")  # the tenant's token: written in its output dir, downloaded here
    assert a["version"] == STEPS and "adapter/adapter_model.safetensors" in a["files"]
    assert a["local_path"] == str(tmp_path / "api") and a["relative_path"] == f"exports/v{STEPS:06d}"
    assert a["path"] == f"exports/v{STEPS:06d}"  # a tenant sees paths relative to its own output dir
    assert (Path(lora.info["output_dir"]) / a["path"] / "manifest.json").is_file()
    assert f"exports/v{STEPS:06d}/manifest.json" in {f["path"] for f in lora.files()}
    assert main(["export", LORA.name, "--version", "2", "--out", str(tmp_path / "cli"),
                 "--root", nx.status()["config"]["root"]]) == 0  # the operator, from the root's gateway files
    printed = capsys.readouterr().out
    assert "version 2" in printed and "head.safetensors" in printed
    assert json.loads((tmp_path / "cli" / "manifest.json").read_text())["version"] == 2

    # server paths: a tenant token only inside its own output dir; nothing is written elsewhere
    for bad in (str(tmp_path / "server-side"), "../pick-plain/exports/x", "weights/v9"):
        with pytest.raises(Forbidden):
            lora.export(1, server_path=bad)
    assert not (tmp_path / "server-side").exists()
    mine = lora.export(1, server_path="exports/custom-v1")
    assert mine["relative_path"] == "exports/custom-v1" and "local_path" not in mine
    with Nexus(nx.service.gateway_url, token=plain.token) as as_plain, pytest.raises(Forbidden):
        as_plain.transport.export(LORA.name, version=1)  # another tenant's export

    for tenant, path in ((lora, tmp_path / "api"), (plain, tmp_path / "plain")):
        if tenant is plain:
            tenant.export(STEPS, path)
        policy = nexus.export.policy.load(path)  # its own backbone, from the checkpoint the manifest names
        assert policy.backbone.cfg.local_path == nx.status()["config"]["backbone"]["local_path"]
        got = np.stack([o["action"] for o in policy.predict_actions(obs)])
        np.testing.assert_allclose(got, service_actions(tenant, obs), atol=1e-5)

    with pytest.raises(NotFound, match="no version 99"):
        lora.export(99, tmp_path / "never")
    with pytest.raises(Conflict):
        lora.export(1, tmp_path / "api")  # exists: refused, left as it was
    assert json.loads((tmp_path / "api" / "manifest.json").read_text())["version"] == STEPS
    assert not (tmp_path / "never").exists()


def test_the_jobs_mlflow_model_loads_and_acts_like_the_service(nx, trained, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    lora, _, _ = trained
    nx.flush()
    st = nx.status()
    uri = f"sqlite:///{st['config']['root']}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    job = next(j for j in st["jobs"] if j["tenant"] == LORA.name and j["kind"] == "sft")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string=f"tags.`nexus.job` = '{job['job']}'")
    assert run.info.status == "FINISHED"
    mlflow.set_tracking_uri(uri)
    # downloaded into tmp_path (by default MLflow makes a /tmp folder of its own and leaves it)
    model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/policy", dst_path=str(tmp_path))
    obs = heldout()
    got = model.predict({"state": np.stack([o.state for o in obs])})
    np.testing.assert_allclose(got, service_actions(lora, obs), atol=1e-5)
    logged = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    assert any(m.source_run_id == run.info.run_id for m in logged)


def test_init_from_an_export_on_a_live_service(nx, trained, tmp_path):
    lora, _, _ = trained
    lora.export(STEPS, tmp_path / "seed")
    seeded = nx.create_tenant(LORA.model_copy(update={"name": "pick-seeded", "seed": 5,
                                                      "init_from": str(tmp_path / "seed")}))
    assert seeded.version == 0
    obs = heldout(3)
    np.testing.assert_allclose(service_actions(seeded, obs), service_actions(lora, obs), atol=1e-5)
    before = {t["tenant"] for t in nx.status()["tenants"]}
    with pytest.raises(NotFound, match="not an exported policy"):
        nx.create_tenant(PLAIN.model_copy(update={"name": "pick-bad", "init_from": str(tmp_path / "missing")}))
    # a tenant token may not start a tenant from a server path outside its own output dir (another's export)
    plain_exports = Path(nx.tenant(PLAIN.name).info["output_dir"]) / "exports" / f"v{STEPS:06d}"
    with Nexus(nx.service.gateway_url, token=lora.token) as as_lora, pytest.raises(Forbidden):
        as_lora.create_tenant(PLAIN.model_copy(update={"name": "pick-stolen", "init_from": str(plain_exports)}))
    assert {t["tenant"] for t in nx.status()["tenants"]} == before
