"""A tenant re-created from its output dir, on a fresh service, continues from its last saved version."""

from __future__ import annotations

import json

import pytest

from nexus.client.api import Nexus
from nexus.data.output_dir import TenantOutputDir
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster


def test_recreated_tenant_resumes_from_output_dir(tmp_path):
    out = tmp_path / "tenant-out"
    spec = TenantSpec(name="resume", dataset="pickcube-scripted", action_dim=4, seed=11, output_dir=str(out))
    # both services let tenants' dirs live in tmp_path (outside their roots): ServiceConfig.output_base
    with Nexus.local(tmp_path / "first", n_sim=1, output_base=str(tmp_path)) as nx:
        t = nx.create_tenant(spec)
        assert t.info["version"] == 0
        res = t.sft(steps=4, batch_size=16).result(timeout=300)
        assert res["version"] == 4
        first_loss = res["loss"]
    manifest = json.loads(TenantOutputDir(out).manifest_path.read_text())
    assert manifest["latest_version"] == 4
    # checkpoint_every=1: every version is durable before it is published; the newest
    # limits.max_checkpoints_kept (3) are kept
    assert [c["version"] for c in manifest["checkpoints"] if not c.get("pruned")] == [2, 3, 4]
    assert [j["state"] for j in manifest["jobs"]] == ["done"]

    with Nexus.local(tmp_path / "second", n_sim=1, output_base=str(tmp_path)) as nx:
        t = nx.create_tenant(spec)
        assert t.info["version"] == 4, "the re-created tenant starts at its last checkpoint"
        res = t.sft(steps=2, batch_size=16).result(timeout=300)
        assert res["version"] == 6
        assert res["loss"] < first_loss * 1.5  # trained weights, not a fresh initialisation
    manifest = json.loads(TenantOutputDir(out).manifest_path.read_text())
    assert [c["version"] for c in manifest["checkpoints"] if not c.get("pruned")] == [4, 5, 6]
    assert [v["version"] for v in manifest["versions"]] == list(range(7)), "each version listed once"
    assert len(manifest["jobs"]) == 2
