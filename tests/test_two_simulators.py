"""Two simulator families in one cluster: tenants on ManiSkill and robosuite at the same time, plus SFT
on a LeRobot-format dataset and an evaluation with LIBERO-like cameras, all named by catalog spec."""

from __future__ import annotations

import json

import pytest

from nexus.client.api import Nexus
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster


def test_tenants_on_two_simulators_share_one_cluster(tmp_path):
    from nexus.data.output_dir import TenantOutputDir
    from nexus.data.trajectory_store import TrajectoryStore, table_arrays
    from nexus.features import TenantSchema

    with Nexus.local(tmp_path, n_sim=2, infer_max_wait_s=0.005) as nx:
        # a vector-env catalog task: two sub-envs per rollout task, one batched policy call per step
        ms = nx.create_tenant(TenantSpec(name="ms-push", env="maniskill/pushcube-state-vec2", seed=1))
        rs = nx.create_tenant(TenantSpec(name="rs-lift", env="robosuite/lift-state", seed=2))
        lr = nx.create_tenant(TenantSpec(name="rs-sft", dataset="robosuite-lift-scripted-lerobot",
                                         env="robosuite/lift-rgb", seed=3))
        jobs = [ms.rl(updates=1, episodes_per_batch=2, collectors=1),
                rs.rl(updates=1, episodes_per_batch=1, collectors=1),
                lr.sft(steps=3, batch_size=8)]
        results = [j.result(timeout=600) for j in jobs]
        assert [r["version"] for r in results] == [ms.version, rs.version, lr.version]
        assert results[0]["updates"] == results[1]["updates"] == 1 and results[2]["steps"] == 3
        report = lr.evaluate(episodes=1).result(timeout=600)  # two 64 px cameras through the backbone
        assert report["episodes"] == 1 and 0.0 <= report["success_rate"] <= 1.0

        for t, env_id, dims in ((ms, "maniskill/pushcube-state-vec2", (35, 4)), (rs, "robosuite/lift-state", (18, 7))):
            out = TenantOutputDir(t.info["output_dir"])
            manifest = json.loads(out.manifest_path.read_text())
            schema = TenantSchema.from_dict(manifest["schema"])
            assert (schema.proprio_dim, schema.action_dim) == dims and manifest["spec"]["env"] == env_id
            rows = table_arrays(TrajectoryStore(out.trajectories, t.name, schema).scan())
            assert len(rows["episode"]) >= 1 and rows["state"].shape[1] == dims[0]
            assert rows["action"].shape[1] == dims[1]
