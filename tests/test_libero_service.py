"""LIBERO through the real service (local Dask cluster, gateway, engines, simulators): the standard evaluation
protocol over a suite, RL on a LIBERO task, and SFT from LIBERO data in LeRobot format (v2.1 and v3.0).

The catalog is the repository's, copied to a temporary root with libero_spatial's step limit cut to 6 steps so
that a CPU box runs it in minutes (the limit the flow applies is the catalog's, whatever it is)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nexus.client.api import Nexus
from nexus.config import catalog
from nexus.errors import SpecError
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
LIMIT = 6  # libero_spatial's step limit in this test's catalog (220 in the shipped one)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A catalog root: the shipped one, libero/spatial's limit cut, plus two LIBERO LeRobot datasets recorded from
    the LIBERO env (random actions), one per layout."""
    from nexus.data.lerobot_format import write_lerobot
    from nexus.sim.base import PolicyOutput
    from nexus.sim.environment import collect_episodes, make_env

    root = tmp_path_factory.mktemp("catalog")
    shutil.copytree(REPO / "envs", root / "envs")
    for d in ("schedulers", "calibrations"):
        (root / d).symlink_to(REPO / d)
    toml = root / "envs" / "libero.toml"
    text = toml.read_text()
    assert "[tasks.spatial]\ndescription" in text and "max_episode_steps = 220" in text
    toml.write_text(text.replace("max_episode_steps = 220", f"max_episode_steps = {LIMIT}"))
    (root / "datasets").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXUS_CATALOG_ROOT", str(root))
        entry = catalog.env("libero/spatial")
        rng = np.random.default_rng(0)
        with make_env(entry, seed=0) as env:
            cols = collect_episodes(env, lambda obs: PolicyOutput(rng.uniform(-1, 1, 7).astype(np.float32)),
                                    episodes=2, seed=0, tenant="recorder")
    # random actions never succeed: the recorded episodes stand in for demonstrations (LIBERO's are all successful,
    # and SFT keeps successful episodes), so each is flagged successful at its last frame
    last = np.r_[cols["episode"][1:] != cols["episode"][:-1], True]
    cols["success"] = np.asarray(cols["success"], bool) | last
    s = entry.schema
    cams = ", ".join(f'{{ name = "{c.name}", height = {c.height}, width = {c.width} }}' for c in s.cameras)
    for layout in ("v2.1", "v3.0"):
        name = f"libero-spatial-random-{layout.replace('.', '')}"
        write_lerobot(root / "datasets" / name, cols, s, fps=20, layout=layout)
        (root / "datasets" / f"{name}.toml").write_text(
            f'name = "{name}"\nformat = "lerobot"\npath = "{name}"\nenv = "libero/spatial"\n\n[schema]\n'
            f'proprio_dim = {s.proprio_dim}\naction_dim = {s.action_dim}\ninstruction = "{s.instruction}"\n'
            f"cameras = [{cams}]\n")
    return root


@pytest.fixture(scope="module")
def nx(root, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXUS_CATALOG_ROOT", str(root))  # the service's processes inherit it
        with Nexus.local(tmp_path_factory.mktemp("svc"), n_sim=2, infer_max_wait_s=0.005) as nx:
            yield nx


def test_suite_evaluation_runs_the_standard_protocol_on_the_chosen_tasks_and_initial_states(nx, root):
    t = nx.create_tenant(TenantSpec(name="lib-eval", env="libero/spatial", action_dim=7, hidden_dim=32, seed=1))
    report = t.evaluate(protocol="suite", tasks=[0, 3], initial_states=2).result(timeout=1500)
    assert report["protocol"] == "suite" and report["episodes"] == 4
    rows = report["tasks"]
    assert [(r["task"], r["env"]) for r in rows] == [(0, "libero/spatial/0"), (3, "libero/spatial/3")]
    for r in rows:
        assert r["episodes"] == 2 and r["initial_states"] == [0, 1]
        assert r["max_episode_steps"] == LIMIT
        assert r["steps"] == 2 * LIMIT or r["success_rate"] > 0  # the catalog's limit ended every failed episode
        assert 0.0 <= r["success_rate"] <= 1.0
    assert rows[1]["instruction"] == "pick up the black bowl on the cookie box and place it on the plate"
    assert report["average_success_rate"] == pytest.approx(np.mean([r["success_rate"] for r in rows]))
    assert report["success_rate"] == pytest.approx(report["average_success_rate"])  # equal episodes per task


def test_suite_evaluation_refuses_a_non_suite_env_and_unknown_tasks(nx):
    t = nx.create_tenant(TenantSpec(name="lib-bad", env="libero/spatial", action_dim=7, hidden_dim=32))
    with pytest.raises(SpecError, match=r"tasks \[10\]"):
        t.evaluate(protocol="suite", tasks=[10], initial_states=1)
    lift = nx.create_tenant(TenantSpec(name="lift-bad", env="robosuite/lift-state", action_dim=7, hidden_dim=32))
    with pytest.raises(SpecError, match="suite"):
        lift.evaluate(protocol="suite", initial_states=1)


def test_rl_on_a_libero_task_advances_versions_and_records_rollouts(nx):
    from nexus.data.output_dir import TenantOutputDir
    from nexus.data.trajectory_store import TrajectoryStore, table_arrays
    from nexus.features import TenantSchema

    t = nx.create_tenant(TenantSpec(name="lib-rl", env="libero/spatial/2", action_dim=7, hidden_dim=32, seed=2))
    v0 = t.version
    res = t.rl(updates=2, episodes_per_batch=1, collectors=1).result(timeout=1500)
    assert res["updates"] == 2 and t.version == res["version"] > v0
    out = TenantOutputDir(t.info["output_dir"])
    schema = TenantSchema.from_dict(json.loads(out.manifest_path.read_text())["schema"])
    cols = table_arrays(TrajectoryStore(out.trajectories, "lib-rl", schema).scan())
    # every episode ran to the catalog's limit (a collector may have run one batch ahead of the last update)
    assert len(cols["step"]) >= 2 * LIMIT and len(cols["step"]) % LIMIT == 0 and cols["state"].shape[1] == 8
    assert cols["step"].max() == LIMIT - 1
    assert set(np.unique(cols["policy_version"])) <= set(range(v0, res["version"]))


@pytest.mark.parametrize("layout", ["v21", "v30"])
def test_sft_reads_libero_data_in_lerobot_format(nx, layout):
    t = nx.create_tenant(TenantSpec(name=f"lib-sft-{layout}", dataset=f"libero-spatial-random-{layout}",
                                    env="libero/spatial", action_dim=7, hidden_dim=32))
    res = t.sft(steps=3, batch_size=4).result(timeout=900)
    assert res["steps"] == 3 and t.version == res["version"] >= 1
