"""The env and dataset catalogs: declarative TOML, refusals at spec validation, no simulator imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nexus.config import catalog
from nexus.config.catalog import CatalogError
from nexus.config.validation import SpecError, validate_tenant

REPO = Path(__file__).resolve().parents[1]


def test_catalog_has_both_simulator_families_and_configs():
    envs = catalog.envs()
    sims = {e.simulator for e in envs.values()}
    assert sims == {"maniskill", "robosuite", "libero"}
    for sim in sims - {"libero"}:  # each family: state and camera tasks (LIBERO: its cameras, as the field uses it)
        modes = {e.obs_mode for e in envs.values() if e.simulator == sim}
        assert "state" in modes and "rgb" in modes, (sim, modes)
    # ManiSkill "configs": different tasks, control modes and observation modes
    ms = [e for e in envs.values() if e.simulator == "maniskill"]
    assert len({e.env_id for e in ms}) >= 3 and len({e.control_mode for e in ms}) >= 2
    lift = catalog.env("robosuite/lift-rgb")  # the LIBERO schema
    assert [c.name for c in lift.schema.cameras] == ["agentview", "robot0_eye_in_hand"]
    assert lift.schema.proprio_dim == 8 and lift.schema.action_dim == 7


def test_every_entry_is_complete():
    for name, e in catalog.envs().items():
        assert e.name == name and e.max_episode_steps > 0 and e.schema.instruction, name
        assert e.success in catalog.SUCCESS_CRITERIA[e.simulator], name
        assert (e.obs_mode == "state") == (not e.schema.cameras), name
    for name, d in catalog.datasets().items():
        assert d.format in catalog.DATASET_FORMATS and d.path.is_dir(), name
        if d.env:
            assert catalog.env(d.env).schema == d.schema, name


@pytest.mark.parametrize("name, reason", [
    ("maniskill/PickSingleYCB", "YCB"),
    ("maniskill/PickSingleYCB-v1", "YCB"),
    ("maniskill/OpenCabinetDrawer-v1", "PartNet"),
])
def test_download_requiring_tasks_are_refused(name, reason):
    with pytest.raises(CatalogError, match=f"refused.*{reason}"):
        catalog.env(name)


@pytest.mark.parametrize("name", sorted(catalog.envs()))
def test_every_env_is_a_valid_tenant_spec(name):
    spec, schema = validate_tenant({"name": "t", "env": name})
    assert schema == catalog.env(name).schema


@pytest.mark.parametrize("name", sorted(catalog.datasets()))
def test_every_dataset_is_a_valid_tenant_spec(name):
    _, schema = validate_tenant({"name": "t", "dataset": name})
    assert schema == catalog.dataset(name).schema


def test_spec_validation_refuses_with_the_reason():
    with pytest.raises(SpecError, match="download"):
        validate_tenant({"name": "t", "env": "maniskill/PickSingleYCB"})
    with pytest.raises(SpecError, match="unknown env"):
        validate_tenant({"name": "t", "env": "libero/libero_10"})  # LIBERO's suites are libero/10, libero/spatial...
    with pytest.raises(SpecError, match="unknown dataset"):
        validate_tenant({"name": "t", "dataset": "no-such-data"})


def _root(tmp_path: Path, extra_env: str = "", extra_ds: str = "") -> Path:
    (tmp_path / "envs").mkdir()
    (tmp_path / "datasets").mkdir()
    for f in (REPO / "envs").glob("*.toml"):
        shutil.copy(f, tmp_path / "envs")
    if extra_env:
        (tmp_path / "envs" / "mine.toml").write_text(extra_env)
    if extra_ds:
        (tmp_path / "datasets" / "mine.toml").write_text(extra_ds)
    return tmp_path


def test_adding_a_task_or_dataset_is_a_toml_edit(tmp_path, monkeypatch):
    root = _root(tmp_path, extra_env="""
simulator = "maniskill"
[tasks.poke]
env_id = "PokeCube-v1"
control_mode = "pd_ee_delta_pos"
max_episode_steps = 30
proprio_dim = 54
action_dim = 4
instruction = "poke the cube with the peg"
""", extra_ds="""
name = "my-lerobot"
format = "lerobot"
path = "~/somewhere/libero_lerobot"
[schema]
proprio_dim = 8
action_dim = 7
cameras = [{ name = "image", height = 256, width = 256 }]
[features]
state = "state"
action = "actions"
cameras = { image = "image" }
""")
    monkeypatch.setenv("NEXUS_CATALOG_ROOT", str(root))
    e = catalog.env("mine/poke")
    assert (e.env_id, e.obs_mode, e.reward_mode, e.num_envs) == ("PokeCube-v1", "state", "dense", 1)
    d = catalog.dataset("my-lerobot")
    assert d.format == "lerobot" and d.path == Path.home() / "somewhere/libero_lerobot"
    assert d.features["action"] == "actions"


def test_a_task_may_not_smuggle_in_a_refused_simulator_task(tmp_path, monkeypatch):
    root = _root(tmp_path, extra_env="""
simulator = "maniskill"
[tasks.ycb]
env_id = "PickSingleYCB-v1"
control_mode = "pd_ee_delta_pos"
max_episode_steps = 30
proprio_dim = 10
action_dim = 4
instruction = "pick"
""")
    monkeypatch.setenv("NEXUS_CATALOG_ROOT", str(root))
    assert "mine/ycb" not in catalog.envs()
    with pytest.raises(CatalogError, match="refused.*YCB"):
        catalog.env("mine/ycb")


PUSH_X = ('simulator = "maniskill"\n[tasks.x]\nenv_id = "PushCube-v1"\ncontrol_mode = "c"\nmax_episode_steps = 5\n'
          'proprio_dim = 1\naction_dim = 1\n')  # a valid task, for bad reward-term declarations


@pytest.mark.parametrize("body, match", [
    ('simulator = "gazebo"\n', "simulator 'gazebo'"),
    ('simulator = "maniskill"\n[tasks.x]\nenv_id = "PushCube-v1"\nobs_mode = "rgb"\ncontrol_mode = "c"\n'
     'max_episode_steps = 5\nproprio_dim = 1\naction_dim = 1\n', "disagree"),
    ('simulator = "robosuite"\n[tasks.x]\nenv_id = "Lift"\ncontrol_mode = "osc_pose"\nmax_episode_steps = 5\n'
     'proprio_dim = 1\naction_dim = 7\nsuccess = "evaluate"\n', "success"),
    ('simulator = "maniskill"\n[tasks.x]\nenv_id = "PushCube-v1"\nmax_episode_steps = 5\n', "lacks"),
    (PUSH_X + 'reward_terms = { success = { distance = ["obj", "goal_region"] } }\n', "reward term 'success'"),
    (PUSH_X + 'reward_terms = { d = { distance = ["obj"] } }\n', "distance takes two objects"),
    (PUSH_X + 'reward_terms = { d = { grasp = "obj.__class__" } }\n', "grasp takes one object"),
    (PUSH_X + 'reward_terms = { d = { distance = ["obj", "goal_region"], axes = "z" } }\n', "axes"),
    (PUSH_X + 'info_terms = ["a b"]\n', "info_terms"),
])
def test_bad_suite_files_are_reported(tmp_path, monkeypatch, body, match):
    monkeypatch.setenv("NEXUS_CATALOG_ROOT", str(_root(tmp_path, extra_env=body)))
    with pytest.raises(CatalogError, match=match):
        catalog.envs()


def test_catalog_imports_no_simulator():
    code = ("import sys, nexus.config.catalog, nexus.config.validation; "
            "nexus.config.catalog.envs(); nexus.config.catalog.datasets(); "
            "bad = [m for m in ('mani_skill', 'sapien', 'robosuite', 'mujoco', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
