"""Launch from files: service / tenant / job TOML, --set overrides, the same validation errors as the API."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nexus.config.service import ServiceConfig, apply_overrides, load_service_config, load_submission, parse_override
from nexus.config.validation import validate_job, validate_tenant
from nexus.errors import SpecError
from nexus.spec import RLJob, SFTJob, TenantSpec

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def test_service_file_gives_the_config_the_api_builds(tmp_path):
    cfg = load_service_config(CONFIGS / "service.toml", [f"root={tmp_path / 'svc'}"])
    assert cfg == ServiceConfig(root=str(tmp_path / "svc"))  # the example file spells out the defaults
    over = load_service_config(CONFIGS / "service.toml", ["backbone.family=paligemma", "infer_max_batch=16",
                                                          "limits.max_versions_kept=4", "cluster.sim_workers=3",
                                                          f"root={tmp_path}"])
    assert (over.backbone.family, over.infer_max_batch, over.limits.max_versions_kept, over.cluster.sim_workers) == (
        "paligemma", 16, 4, 3)
    # the config round-trips through the JSON file the workers read
    assert ServiceConfig.load(over.save(tmp_path / "service.json")) == over


def test_relative_root_is_taken_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.toml").write_text('root = "runs/x"\n')
    assert load_service_config(tmp_path / "s.toml").root == str(tmp_path / "runs" / "x")
    # keyword fields (what `nexus up --root` passes) beat the file, overrides beat both
    assert load_service_config(tmp_path / "s.toml", root="other").root == str(tmp_path / "other")
    assert load_service_config(tmp_path / "s.toml", ["root=third"], root="other").root == str(tmp_path / "third")


@pytest.mark.parametrize("text, override, message", [
    ("infer_max_batch = 0\n", None, "infer_max_batch: Input should be greater than or equal to 1"),
    ("no_such_field = 1\n", None, "no_such_field: Extra inputs are not permitted"),
    ("[backbone]\nfamily = 3\n", None, "backbone.family"),
    ("root = \n", None, "invalid TOML"),
    ("", "limits.max_versions_kept=-1", "limits.max_versions_kept"),
    ("", "retention.keep_last=3", "retention.keep_last is now limits.max_versions_kept"),  # the old spelling
    ("[qos]\ngc_freeze = false\n", None, "qos.gc_freeze is now gc.freeze"),
    ("[datapath]\nsync_policy = 'eager'\n", None, "datapath.sync_policy is now datapath.sync_mode"),
    ("", "infer_max_batch", "expected key=value"),
    ("[backbone]\nfamily = 'qwen3vl'\n", "backbone.family.x=1", "backbone.family is a value"),
])
def test_bad_service_files_are_refused_with_the_field(tmp_path, text, override, message):
    path = tmp_path / "service.toml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message) as e:
        load_service_config(path, [override] if override else [])
    assert "\n" not in str(e.value)


def test_dask_settings_of_the_service_processes(tmp_path):
    """cluster.dask_config: dotted Dask keys over DASK_DEFAULTS, handed to the child processes as the
    environment variables Dask reads; a key that is not a dotted setting is refused."""
    env = ServiceConfig(root=str(tmp_path)).cluster.dask_env()
    assert env["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] == "False"
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL"] == "1s"
    path = tmp_path / "s.toml"
    path.write_text('[cluster.dask_config]\n"distributed.worker.profile.enabled" = true\n'
                    '"distributed.comm.timeouts.connect" = "45s"\n')
    env = load_service_config(path, [f"root={tmp_path}"]).cluster.dask_env()
    assert env["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] == "True"  # the file wins over the default
    assert env["DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT"] == "45s"
    assert env["DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL"] == "500ms"  # the other defaults stay
    assert env["DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON"] == "{'MALLOC_TRIM_THRESHOLD_': None}"  # unset
    path.write_text('[cluster.dask_config]\n"distributed.nanny.pre-spawn-environ" = {MALLOC_ARENA_MAX = 2}\n')
    env = load_service_config(path, [f"root={tmp_path}"]).cluster.dask_env()  # a table adds to the default's
    assert ast.literal_eval(env["DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON"]) == {"MALLOC_TRIM_THRESHOLD_": None,
                                                                               "MALLOC_ARENA_MAX": 2}
    path.write_text('[cluster.dask_config]\n"tick interval" = "1s"\n')
    with pytest.raises(SpecError, match="'tick interval' is not a dotted Dask setting"):
        load_service_config(path, [f"root={tmp_path}"])


def test_the_tracker_has_its_own_worker_only_when_said(tmp_path):
    """(An emulated service says it: ``nexus.emulator.service.configure``, tests/test_emulation.py.)"""
    assert not ServiceConfig(root=str(tmp_path)).resolved_tracker_worker()  # an INFER worker's, as in the paper
    assert ServiceConfig(root=str(tmp_path), cluster={"tracker_worker": True}).resolved_tracker_worker()
    assert not ServiceConfig(root=str(tmp_path), cluster={"tracker_worker": False}).resolved_tracker_worker()
    cfg = load_service_config(None, [f"root={tmp_path}", "cluster.tracker_worker=true"])
    assert cfg.resolved_tracker_worker()


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_service_config(tmp_path / "nope.toml")
    with pytest.raises(SpecError, match="no such file"):
        load_submission([tmp_path / "nope.toml"])


def test_override_values_are_toml_values_or_strings():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("lr=1e-3") == (["lr"], 1e-3)
    assert parse_override("flag=true") == (["flag"], True)
    assert parse_override('name="x y"') == (["name"], "x y")
    assert parse_override("root=runs/a") == (["root"], "runs/a")
    assert parse_override("dims=[1, 2]") == (["dims"], [1, 2])
    doc = {"a": {"b": 1}}
    assert apply_overrides(doc, ["a.c=2", "d.e=x"]) == {"a": {"b": 1, "c": 2}, "d": {"e": "x"}}
    assert doc == {"a": {"b": 1}}  # the input is not changed


def test_demo_files_are_the_specs_the_api_takes():
    """Every example submission validates exactly as the API's dicts do, and equals the typed specs."""
    sub = load_submission([CONFIGS / "demo" / "pick-sft.toml"])
    spec, _ = validate_tenant(sub.tenant)
    assert spec == TenantSpec(name="pick-sft", dataset="pickcube-scripted", env="maniskill/pickcube-state",
                              action_head="pi", chunk=4, hidden_dim=128, lr=1e-3, max_inflight=2, seed=0)
    assert [validate_job(spec, j) for j in sub.jobs] == [SFTJob(steps=1500, batch_size=64)]
    for f in ("push-rl", "pick-rgb"):
        sub = load_submission([CONFIGS / "demo" / f"{f}.toml"])
        spec, _ = validate_tenant(sub.tenant)
        assert all(isinstance(validate_job(spec, j), RLJob) for j in sub.jobs)
    job = load_submission([CONFIGS / "jobs" / "eval.toml"], ["job.episodes=3"], tenant="pick-sft")
    assert job.tenant is None and job.name == "pick-sft" and job.jobs == [{"kind": "eval", "episodes": 3}]


def test_tenant_and_job_files_combine_and_override(tmp_path):
    (tmp_path / "t.toml").write_text('name = "a"\nenv = "maniskill/pushcube-state"\n')
    (tmp_path / "j.toml").write_text('kind = "rl"\nupdates = 2\n[ppo]\ngamma = 0.9\n')
    (tmp_path / "j2.toml").write_text('[[jobs]]\nkind = "eval"\n[[jobs]]\nkind = "eval"\nepisodes = 2\n')
    sub = load_submission([tmp_path / "t.toml", tmp_path / "j.toml", tmp_path / "j2.toml"],
                          ["tenant.lr=0.01", "job.episodes_per_batch=3"])
    assert sub.tenant == {"name": "a", "env": "maniskill/pushcube-state", "lr": 0.01}
    assert [j["kind"] for j in sub.jobs] == ["rl", "eval", "eval"]
    assert sub.jobs[0] == {"kind": "rl", "updates": 2, "ppo": {"gamma": 0.9}, "episodes_per_batch": 3}
    spec, _ = validate_tenant(sub.tenant)
    assert validate_job(spec, sub.jobs[0]) == RLJob(updates=2, episodes_per_batch=3, ppo={"gamma": 0.9})
    with pytest.raises(SpecError, match="episodes_per_batch: Extra inputs"):  # an override an eval has no field for
        validate_job(spec, sub.jobs[1])


def test_submission_errors(tmp_path):
    (tmp_path / "t.toml").write_text('name = "a"\nenv = "maniskill/pushcube-state"\n')
    (tmp_path / "j.toml").write_text('kind = "eval"\n')
    with pytest.raises(SpecError, match="a second tenant"):
        load_submission([tmp_path / "t.toml", tmp_path / "t.toml"])
    with pytest.raises(SpecError, match="no tenant"):
        load_submission([tmp_path / "j.toml"])
    (tmp_path / "named.toml").write_text('tenant = "a"\nkind = "eval"\n')
    assert load_submission([tmp_path / "named.toml"]).name == "a"
    with pytest.raises(SpecError, match="start with 'tenant.' or 'job.'"):
        load_submission([tmp_path / "t.toml"], ["lr=1"])
    with pytest.raises(SpecError, match="has no job"):
        load_submission([tmp_path / "t.toml"], ["job.steps=1"])
    (tmp_path / "bad.toml").write_text('[tenant]\nname = "a"\n[[jobs]]\nkind = "sft"\nsteps = "many"\n')
    sub = load_submission([tmp_path / "bad.toml"])
    with pytest.raises(SpecError, match="invalid tenant spec: spec: Value error, a tenant needs an 'env'"):
        validate_tenant(sub.tenant)  # the same message the service answers create_tenant with
