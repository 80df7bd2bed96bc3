"""Tenants are strangers: the gateway against one live service (real Dask, DeepSpeed, ManiSkill, HTTP).

* a table of malformed inputs, each refused with its error class and a phrase of its message, while
  the service's tenants, slots, versions and tokens stay as they were and another tenant's RL job runs
  on and completes;
* hypothesis fuzzing of specs, observations and batches at the gateway: never a 500, never a change;
* cross-tenant access: tenant A's token on every read and write of tenant B, no token, the operator;
* every listening socket of the service on loopback; the tenant's files 0600 / dirs 0700;
* an oversized head refused before any slot is built, and the actor never restarts;
* quotas: versions kept, storage bytes, queued calls.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexus.client.api import Nexus, Tenant
from nexus.errors import Conflict, Forbidden, LimitExceeded, NotFound, SpecError, Unauthorized
from nexus.features import Observation
from nexus.spec import TenantSpec
from nexus.wire.inputs import encode_array

pytestmark = pytest.mark.cluster

PUSH = "maniskill/pushcube-state"
TENANT_LIMITS = {
    "big": {"max_hidden_dim": 100_000},  # passes validation: the actor's own budget check must refuse it
    "big2": {"max_hidden_dim": 100_000, "max_head_bytes": 10**13},
    "keep2": {"max_versions_kept": 2},
    "q1": {"max_queued_ops": 1},
    "store1": {"max_storage_bytes": 1},
}


class Api:
    """Raw HTTP against the gateway (what a hostile client sends)."""

    def __init__(self, url: str, tokens: dict[str, str | None]) -> None:
        self.http = httpx.Client(base_url=url, timeout=120)
        self.tokens = tokens

    def __call__(self, method: str, path: str, who: str | None = None, **kw) -> httpx.Response:
        token = self.tokens.get(who, who) if who else None
        headers = {**kw.pop("headers", {}), **({"Authorization": f"Bearer {token}"} if token else {})}
        return self.http.request(method, path, headers=headers, **kw)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    with Nexus.local(root, n_sim=1, limits={"max_request_bytes": 2**20}, tenant_limits=TENANT_LIMITS) as nx:
        t = {s.name: nx.create_tenant(s) for s in (
            TenantSpec(name="bg", env=PUSH, seed=1),
            TenantSpec(name="a", env=PUSH, seed=2),
            TenantSpec(name="b", env=PUSH, seed=3),
            TenantSpec(name="sft", dataset="pickcube-scripted", env="maniskill/pickcube-state", seed=4),
            TenantSpec(name="flow", dataset="pickcube-scripted", env="maniskill/pickcube-state", action_head="groot",
                       hidden_dim=64, seed=5),
            TenantSpec(name="keep2", env=PUSH, seed=6),
            TenantSpec(name="q1", env=PUSH, seed=7),
            TenantSpec(name="store1", env=PUSH, seed=8))}
        b = t["b"]  # give B a version beyond 0 and a job of its own
        b.forward_backward(_batch(2)).result(120)
        b.optim_step().result(120)
        assert b.save_weights().result(120) == 1
        b_job = b.evaluate(episodes=1)
        b_job.result(timeout=300)
        tokens = {name: x.token for name, x in t.items()} | {"op": nx.service.operator_token, "bad": "nxt_not-a-token"}
        api = Api(nx.service.gateway_url, tokens)
        yield {"nx": nx, "t": t, "api": api, "b_job": b_job.id, "root": Path(nx.service.config.root)}


def _obs(d: int = 35, **kw) -> dict:
    return {"state": encode_array(np.linspace(-1, 1, d).astype(np.float32)), **kw}


def _batch(n: int, d: int = 35, a: int = 4) -> dict:
    rng = np.random.default_rng(n)
    return {"observations": [Observation(state=rng.standard_normal(d).astype(np.float32)) for _ in range(n)],
            "actions": rng.uniform(-1, 1, (n, a)).astype(np.float32)}


def _wire_batch(n: int = 2, **over) -> dict:
    return {"observations": [_obs() for _ in range(n)], "actions": encode_array(np.zeros((n, 4), np.float32)),
            **over}


def snapshot(env) -> dict:
    """Tenants, versions, jobs, slots (actor), live heads (inference) and tokens — bg excepted, whose RL
    job runs meanwhile."""
    from nexus.worker.plugin import slot_states

    nx = env["nx"]
    st_ = nx.status()
    actor = next(w["address"] for w in st_["workers"] if "ACTOR" in w["resources"])
    slots = nx.service.client.run(slot_states, workers=[actor])[actor]
    live = nx.service.engine().versions().result()["live"]
    tokens = json.loads((env["root"] / "gateway" / "tokens.json").read_text())["tenants"]
    return {"tenants": {t["tenant"]: t["version"] for t in st_["tenants"] if t["tenant"] != "bg"},
            "names": sorted(t["tenant"] for t in st_["tenants"]),
            "jobs": sorted(j["job"] for j in st_["jobs"] if j["tenant"] != "bg"),
            "slots": {k: v for k, v in slots.items() if k != "bg"}, "slot_names": sorted(slots),
            "live": {k: v for k, v in live.items() if k != "bg"}, "tokens": sorted(tokens)}


def _error(r: httpx.Response) -> tuple[str, str]:
    err = r.json()["error"]
    return err["class"], err["message"]


NAN_ACTIONS = encode_array(np.array([[np.nan, 0, 0, 0], [0, 0, 0, 0]], np.float32))
INF_STATE = {"state": encode_array(np.array([np.inf] + [0] * 34, np.float32))}
T = "/v1/tenants"
FB = "/v1/tenants/a/forward_backward"
PRED = "/v1/tenants/a/predict"

# (case, method, path, who, request kwargs, expected class, phrase of the message)
MALFORMED = [
    # first, while bg's RL job surely runs
    ("second training job", "POST", "/v1/tenants/bg/jobs", "bg", {"json": {"kind": "rl"}}, Conflict,
     "already runs training job"),
    # -- tenant specs
    ("unknown env", "POST", T, None, {"json": {"name": "x1", "env": "maniskill/nope"}}, SpecError, "unknown env"),
    ("env needs a download", "POST", T, None, {"json": {"name": "x2", "env": "maniskill/PickSingleYCB"}},
     SpecError, "download"),
    ("action_dim mismatch", "POST", T, None, {"json": {"name": "x3", "env": PUSH, "action_dim": 7}}, SpecError,
     "action_dim=7"),
    ("no env nor dataset", "POST", T, None, {"json": {"name": "x4"}}, SpecError, "needs an 'env'"),
    ("bad name", "POST", T, None, {"json": {"name": "Bad Name!", "env": PUSH}}, SpecError, "name"),
    ("name missing", "POST", T, None, {"json": {"env": PUSH}}, SpecError, "name: Field required"),
    ("unknown spec field", "POST", T, None, {"json": {"name": "x5", "env": PUSH, "gpu": 8}}, SpecError,
     "gpu: Extra inputs"),
    ("hidden_dim=20000", "POST", T, None, {"json": {"name": "x6", "env": PUSH, "hidden_dim": 20000}},
     LimitExceeded, "hidden_dim=20000 is over the limit max_hidden_dim=4096"),
    ("hidden_dim=4", "POST", T, None, {"json": {"name": "x7", "env": PUSH, "hidden_dim": 4}}, SpecError,
     "hidden_dim"),
    ("seed=10000", "POST", T, None, {"json": {"name": "x8", "env": PUSH, "seed": 10_000}}, LimitExceeded,
     "seed=10000 is over the limit max_seed=600"),
    ("seed=10**30", "POST", T, None, {"json": {"name": "x9", "env": PUSH, "seed": 10**30}}, LimitExceeded,
     "max_seed"),
    ("seed=-1", "POST", T, None, {"json": {"name": "x10", "env": PUSH, "seed": -1}}, SpecError, "seed"),
    ("init_log_std=NaN", "POST", T, None,
     {"content": b'{"name": "x11", "env": "maniskill/pushcube-state", "init_log_std": NaN}',
      "headers": {"Content-Type": "application/json"}}, SpecError, "init_log_std"),
    ("lr=inf", "POST", T, None,
     {"content": b'{"name": "x12", "env": "maniskill/pushcube-state", "lr": Infinity}',
      "headers": {"Content-Type": "application/json"}}, SpecError, "lr"),
    ("lr as string", "POST", T, None, {"json": {"name": "x13", "env": PUSH, "lr": "fast"}}, SpecError, "lr"),
    ("max_inflight=100", "POST", T, None, {"json": {"name": "x14", "env": PUSH, "max_inflight": 100}},
     LimitExceeded, "max_inflight=8"),
    ("priority=10**6", "POST", T, None, {"json": {"name": "x15", "env": PUSH, "priority": 10**6}}, LimitExceeded,
     "max_priority=10"),
    ("groot width not /4", "POST", T, None,
     {"json": {"name": "x16", "dataset": "pickcube-scripted", "action_head": "groot", "hidden_dim": 30}},
     SpecError, "multiple of 4"),
    ("output_dir absolute elsewhere", "POST", T, None, {"json": {"name": "x17", "env": PUSH, "output_dir": "/tmp/x"}},
     Forbidden, "owned by the service"),
    ("output_dir ../b", "POST", T, None, {"json": {"name": "x18", "env": PUSH, "output_dir": "../b"}}, Forbidden,
     "output_dir"),
    ("spec is a list", "POST", T, None, {"json": [1, 2]}, SpecError, "invalid request"),
    ("spec not JSON", "POST", T, None, {"content": b"{nope", "headers": {"Content-Type": "application/json"}},
     SpecError, "JSON"),
    ("existing name, no token", "POST", T, None, {"json": {"name": "b", "env": PUSH}}, Conflict, "exists"),
    ("body over max_request_bytes", "POST", T, None, {"content": b"[" + b"0," * 600_000 + b"0]",
                                                      "headers": {"Content-Type": "application/json"}},
     LimitExceeded, "max_request_bytes"),
    # -- jobs
    ("unknown job kind", "POST", "/v1/tenants/a/jobs", "a", {"json": {"kind": "dance"}}, SpecError, "kind"),
    ("sft without dataset", "POST", "/v1/tenants/a/jobs", "a", {"json": {"kind": "sft"}}, SpecError,
     "has no dataset"),
    ("unknown job field", "POST", "/v1/tenants/a/jobs", "a", {"json": {"kind": "rl", "gpus": 2}}, SpecError, "gpus"),
    ("eval of 10**6 episodes", "POST", "/v1/tenants/a/jobs", "a", {"json": {"kind": "eval", "episodes": 10**6}},
     LimitExceeded, "episodes=1000000 is over the limit max_eval_episodes=500"),
    ("rl updates=10**9", "POST", "/v1/tenants/a/jobs", "a", {"json": {"kind": "rl", "updates": 10**9}},
     LimitExceeded, "max_rl_updates"),
    ("rl collectors=1000", "POST", "/v1/tenants/a/jobs", "a", {"json": {"kind": "rl", "collectors": 1000}},
     LimitExceeded, "max_collectors=8"),
    ("rl update_epochs=1000", "POST", "/v1/tenants/a/jobs", "a",
     {"json": {"kind": "rl", "ppo": {"update_epochs": 1000}}}, LimitExceeded, "max_update_epochs"),
    ("rl episodes_per_batch=0", "POST", "/v1/tenants/a/jobs", "a", {"json": {"kind": "rl", "episodes_per_batch": 0}},
     SpecError, "episodes_per_batch"),
    ("eval of a version not made yet", "POST", "/v1/tenants/a/jobs", "a", {"json": {"kind": "eval", "version": 999}},
     NotFound, "no version 999"),
    ("sft steps=10**7", "POST", "/v1/tenants/sft/jobs", "sft", {"json": {"kind": "sft", "steps": 10**7}},
     LimitExceeded, "max_sft_steps"),
    # -- low-level batches
    ("empty batch", "POST", FB, "a", {"json": {"batch": {"observations": [], "actions": []}}}, SpecError,
     "the batch is empty"),
    ("batch is a list", "POST", FB, "a", {"json": {"batch": [1, 2]}}, SpecError, "batch"),
    ("no batch", "POST", FB, "a", {"json": {"loss": "sft"}}, SpecError, "batch: Field required"),
    ("wrong action dims", "POST", FB, "a",
     {"json": {"batch": _wire_batch(actions=np.zeros((2, 7)).tolist())}}, SpecError,
     "batch.actions: expected shape (2, 4)"),
    ("NaN actions", "POST", FB, "a", {"json": {"batch": _wire_batch(actions=NAN_ACTIONS)}}, SpecError,
     "batch.actions: 1 value(s) are NaN or infinite"),
    ("inf in a state", "POST", FB, "a", {"json": {"batch": _wire_batch(observations=[INF_STATE, _obs()])}},
     SpecError, "batch.observations[0].state: 1 value(s) are NaN or infinite"),
    ("string actions", "POST", FB, "a",
     {"json": {"batch": _wire_batch(actions=[["up"] * 4, ["down"] * 4])}}, SpecError, "non-numbers"),
    ("state=None", "POST", FB, "a", {"json": {"batch": _wire_batch(observations=[{"state": None}, _obs()])}},
     SpecError, "batch.observations[0].state: got null"),
    ("state of 34", "POST", FB, "a", {"json": {"batch": _wire_batch(observations=[_obs(34), _obs()])}}, SpecError,
     "expected 35 numbers"),
    ("huge actions", "POST", FB, "a", {"json": {"batch": _wire_batch(actions=[[1e30] * 4] * 2)}}, SpecError,
     "magnitudes"),
    ("unknown loss", "POST", FB, "a", {"json": {"batch": _wire_batch(), "loss": "l1"}}, SpecError, "loss"),
    ("ppo without advantages", "POST", FB, "a",
     {"json": {"batch": _wire_batch(logprobs=[0, 0], returns=[0, 0]), "loss": "ppo"}}, SpecError,
     "batch.advantages: missing"),
    ("rows over max_batch_rows", "POST", FB, "a",
     {"json": {"batch": {"observations": [{"state": [0] * 35}] * 4097, "actions": [[0] * 4] * 4097}}},
     LimitExceeded, "max_batch_rows=4096"),
    ("optim_step without forward_backward", "POST", "/v1/tenants/a/optim_step", "a", {}, Conflict,
     "without a forward_backward"),
    # -- observations
    ("predict: state of 10", "POST", PRED, "a", {"json": {"observation": _obs(10)}}, SpecError,
     "observation.state: expected 35 numbers"),
    ("predict: unknown camera", "POST", PRED, "a", {"json": {"observation": _obs(images={"wrist": [[[0, 0, 0]]]})}},
     SpecError, "unknown camera(s) ['wrist']"),
    ("predict: unknown field", "POST", PRED, "a", {"json": {"observation": _obs(depth=[1])}}, SpecError,
     "unknown field(s) ['depth']"),
    ("predict: observation a list", "POST", PRED, "a", {"json": {"observation": [0] * 35}}, SpecError,
     "observation"),
    ("predict: version unknown", "POST", PRED, "a", {"json": {"observation": _obs(), "version": 999}}, NotFound,
     "neither live nor pinned"),
    ("predict: version=-1", "POST", PRED, "a", {"json": {"observation": _obs(), "version": -1}}, SpecError,
     "version"),
    # -- API calls
    ("unknown tenant (operator)", "GET", "/v1/tenants/nope", "op", {}, NotFound, "unknown tenant 'nope'"),
    ("unknown job", "GET", "/v1/jobs/nope-rl-1", "a", {}, NotFound, "unknown job"),
    ("result timeout out of range", "GET", "/v1/jobs/nope/result", "a", {"params": {"timeout": 1e9}}, SpecError,
     "timeout"),
    ("unknown route", "GET", "/v1/nothing-here", "a", {}, NotFound, "Not Found"),
    ("no token", "GET", "/v1/tenants/a", None, {}, Unauthorized, "no token"),
    ("unknown token", "GET", "/v1/tenants/a", "bad", {}, Unauthorized, "unknown token"),
    ("admin call with a tenant token", "GET", "/v1/admin/monitoring", "a", {}, Forbidden, "operator token"),
    ("scale to 0 engines", "POST", "/v1/admin/scale", "op", {"json": {"engines": 0}}, SpecError, "engines"),
    ("file path with ..", "GET", "/v1/tenants/a/files/..%2Fb%2Fmanifest.json", "a", {}, Forbidden, ".."),
    ("file that does not exist", "GET", "/v1/tenants/a/files/nothing.bin", "a", {}, NotFound, "nothing.bin"),
    ("a directory as a file", "GET", "/v1/tenants/a/files/weights", "a", {}, SpecError, "directory"),
]


def test_malformed_inputs_refused_and_nothing_changes(env):
    assert len(MALFORMED) >= 40
    bg = env["t"]["bg"].rl(updates=6, episodes_per_batch=1, collectors=1)
    before = snapshot(env)
    failures = []
    for case, method, path, who, kw, cls, phrase in MALFORMED:
        r = env["api"](method, path, who, **kw)
        got_cls, msg = _error(r) if r.status_code >= 400 else ("-", r.text[:200])
        status = 413 if "max_request_bytes" in phrase else cls.http_status  # 413: refused before parsing
        ok = r.status_code == status and got_cls == cls.__name__ and phrase in msg
        if not ok:
            failures.append(f"{case}: HTTP {r.status_code} {got_cls}: {msg}")
        after = snapshot(env)
        if after != before:
            failures.append(f"{case}: the service changed: {before} -> {after}")
            before = after
    assert not failures, "\n".join(failures)
    res = bg.result(timeout=600)  # another tenant's RL job ran on through all of it
    assert res["updates"] == 6 and bg.info()["state"] == "done"


def test_oversized_head_refused_before_any_slot_and_actor_never_restarts(env):
    import os as _os

    nx = env["nx"]
    actor = next(w["address"] for w in nx.status()["workers"] if "ACTOR" in w["resources"])
    pid = nx.service.client.run(_os.getpid, workers=[actor])[actor]
    before = snapshot(env)
    with pytest.raises(LimitExceeded, match="max_hidden_dim=4096"):  # at validation, in the gateway
        nx.create_tenant(TenantSpec(name="huge", env=PUSH, hidden_dim=20000))
    with pytest.raises(LimitExceeded, match="max_head_bytes"):  # past validation: the actor's estimate refuses
        nx.create_tenant(TenantSpec(name="big", env=PUSH, hidden_dim=20000))
    with pytest.raises(LimitExceeded, match="left of its budget"):  # the actor's memory budget refuses
        nx.create_tenant(TenantSpec(name="big2", env=PUSH, hidden_dim=20000))
    assert snapshot(env) == before
    workers = nx.status()["workers"]
    assert nx.service.client.run(_os.getpid, workers=[actor])[actor] == pid and len(workers) == 3
    # the other tenants still train: a step on a's slot lowers its loss on the batch it stepped on
    a = env["t"]["a"]
    first = a.forward_backward(_batch(2)).result(120)["metrics"]["loss"]
    a.optim_step().result(120)
    assert a.forward_backward(_batch(2)).result(120)["metrics"]["loss"] < first
    a.optim_step().result(120)  # (its gradients consumed, as before)


def _status(api, method, path, who, **kw) -> int:
    return api(method, path, who, **kw).status_code


def test_cross_tenant_access(env):
    api, b_job, nx = env["api"], env["b_job"], env["nx"]
    b_dir = Path(nx.tenant("b").info["output_dir"])
    a_dir = Path(nx.tenant("a").info["output_dir"])
    obs = {"observation": _obs()}
    b_action = api("POST", "/v1/tenants/b/predict", "b", json=obs).json()["action"]
    before = snapshot(env)
    os.symlink(b_dir / "manifest.json", a_dir / "b-manifest")  # planted inside A's dir, pointing at B's
    reads_writes = [
        ("GET", "/v1/tenants/b", {}), ("GET", "/v1/tenants/b/logs", {}), ("GET", "/v1/tenants/b/jobs", {}),
        ("POST", "/v1/tenants/b/jobs", {"json": {"kind": "eval", "episodes": 1}}),
        ("POST", "/v1/tenants/b/jobs", {"json": {"kind": "rl", "updates": 1}}),
        ("POST", "/v1/tenants/b/forward_backward", {"json": {"batch": _wire_batch()}}),
        ("POST", "/v1/tenants/b/optim_step", {}), ("POST", "/v1/tenants/b/save_weights", {}),
        ("POST", "/v1/tenants/b/predict", {"json": obs}),
        ("POST", "/v1/tenants/b/export", {"json": {}}), ("DELETE", "/v1/tenants/b", {}),
        ("GET", "/v1/tenants/b/files", {}), ("GET", "/v1/tenants/b/files/manifest.json", {}),
        ("GET", "/v1/tenants/b/files/weights/v000001.pt", {}),
        ("GET", f"/v1/jobs/{b_job}", {}), ("GET", f"/v1/jobs/{b_job}/result", {"params": {"timeout": 0}}),
        ("GET", f"/v1/jobs/{b_job}/stream", {}), ("POST", f"/v1/jobs/{b_job}/cancel", {}),
    ]
    admin = [("GET", "/v1/admin/monitoring", {}), ("GET", "/v1/admin/tenants", {}), ("POST", "/v1/admin/flush", {}),
             ("POST", "/v1/admin/scale", {"json": {"engines": 1}})]
    table = []
    for method, path, kw in reads_writes + admin:
        a_code, none_code = _status(api, method, path, "a", **kw), _status(api, method, path, None, **kw)
        table.append((method, path, a_code, none_code))
        expected = 404 if path.startswith("/v1/jobs/") else 403
        assert a_code == expected, (method, path, a_code)
        assert none_code == 401, (method, path, none_code)
    # B's files through A's own dir: '..' and a planted symlink are refused
    assert _status(api, "GET", "/v1/tenants/a/files/..%2Fb%2Fmanifest.json", "a") == 403
    assert _status(api, "GET", "/v1/tenants/a/files/b-manifest", "a") == 403
    assert "b-manifest" not in {f["path"] for f in api("GET", "/v1/tenants/a/files", "a").json()["files"]}
    # taking B's name or B's dir
    assert _status(api, "POST", T, "a", json={"name": "b", "env": PUSH}) == 409
    assert _status(api, "POST", T, "a", json={"name": "c", "env": PUSH, "output_dir": str(b_dir)}) == 403
    # A's status shows A only
    st = api("GET", "/v1/status", "a").json()
    assert [t["tenant"] for t in st["tenants"]] == ["a"] and all(j["tenant"] == "a" for j in st["jobs"])
    assert "config" not in st and "workers" not in st
    # a grouped inference span names A only in A's logs
    assert {sp["tenant"] for sp in api("GET", "/v1/tenants/a/logs", "a").json()["spans"]} <= {"a"}
    (a_dir / "b-manifest").unlink()
    assert snapshot(env) == before
    assert api("POST", "/v1/tenants/b/predict", "b", json=obs).json()["action"] == b_action  # B's head untouched
    # the operator's admin calls work, on every tenant
    op = {path: _status(api, m, path, "op", **kw) for m, path, kw in [
        ("GET", "/v1/status", {}), ("GET", "/v1/tenants/b", {}), ("GET", "/v1/tenants/b/logs", {}),
        ("GET", "/v1/admin/monitoring", {}), ("GET", "/v1/admin/tenants", {}), ("POST", "/v1/admin/flush", {}),
        ("GET", f"/v1/jobs/{b_job}", {}), ("GET", "/v1/tenants/b/files/manifest.json", {})]}
    assert set(op.values()) == {200}, op
    full = api("GET", "/v1/status", "op").json()
    assert {"a", "b", "bg"} <= {t["tenant"] for t in full["tenants"]} and "workers" in full
    # scale and export (the control plane's handlers, issues 8 and 11) on any tenant
    assert _status(api, "POST", "/v1/admin/scale", "op", json={"engines": 1}) == 200
    r = api("POST", "/v1/tenants/b/export", "op")
    assert r.status_code == 200, r.text
    assert r.json()["relative_path"].startswith("exports/v") and Path(r.json()["path"]).parent == b_dir / "exports"
    # B's own token: into B's dir only (a server path elsewhere is refused, and nothing written there)
    assert _status(api, "POST", "/v1/tenants/b/export", "b", json={"path": str(a_dir / "stolen")}) == 403
    assert _status(api, "POST", "/v1/tenants/b/export", "b", json={"path": "/tmp/b-export"}) == 403
    assert not (a_dir / "stolen").exists() and not Path("/tmp/b-export").exists()


def test_b_files_private_on_disk(env):
    b_dir = Path(env["nx"].tenant("b").info["output_dir"])
    paths = [b_dir, *b_dir.rglob("*")]
    assert any(p.name == "manifest.json" for p in paths) and any(p.suffix == ".pt" for p in paths)
    loose = [f"{stat.S_IMODE(p.lstat().st_mode):o} {p}" for p in paths if p.lstat().st_mode & 0o077]
    assert not loose, loose
    root = env["root"]
    for p in (root / "gateway" / "tokens.json", root / "gateway" / "operator.token", root / "service.json"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_every_listening_socket_is_loopback(env):
    listening = env["nx"].service.listening()
    kinds = {name.split()[1] if len(name.split()) > 1 else name for _, name, _, _ in listening}
    assert len(listening) >= 8, listening  # scheduler (comm + dashboard), nannies, workers' comm + HTTP, gateway
    assert any("nexus.gateway" in name for _, name, _, _ in listening), kinds
    outside = [x for x in listening if x[2] not in ("127.0.0.1", "::1")]
    assert not outside, outside


def test_chunked_bodies_are_limited_too(env):
    """Without a Content-Length the gateway counts the bytes as they come."""
    api = env["api"]

    def chunks(body: bytes, size: int = 65536):
        yield from (body[i:i + size] for i in range(0, len(body), size))

    small = json.dumps({"name": "chunky", "env": PUSH, "hidden_dim": 3}).encode()
    r = api("POST", T, None, content=chunks(small), headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "hidden_dim" in _error(r)[1]  # read whole, then validated
    big = b"[" + b"0," * 700_000 + b"0]"
    r = api("POST", T, None, content=chunks(big), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "max_request_bytes" in _error(r)[1]


def test_openapi_docs_served(env):
    api = env["api"]
    spec = api("GET", "/openapi.json").json()
    for route in ("/v1/tenants", "/v1/tenants/{tenant}/forward_backward", "/v1/tenants/{tenant}/predict",
                  "/v1/jobs/{job_id}/stream", "/v1/admin/scale"):
        assert route in spec["paths"], route
    assert api("GET", "/docs").status_code == 200


def test_quotas_versions_kept_storage_and_queued_calls(env):
    api = env["api"]
    keep2 = env["t"]["keep2"]
    for _ in range(3):
        keep2.forward_backward(_batch(2)).result(120)
        keep2.optim_step().result(120)
        keep2.save_weights().result(120)
    weights = sorted(f["path"] for f in keep2.files() if f["path"].startswith("weights/"))
    # retention: the newest 2 and the initial version (nexus.data.output_dir.TenantOutputDir.prune)
    assert weights == ["weights/v000000.pt", "weights/v000002.pt", "weights/v000003.pt"]
    manifest = json.loads(keep2.read_file("manifest.json"))
    on_disk = Path(keep2.info["output_dir"]) / "weights" / "v000003.pt"
    assert keep2.read_file("weights/v000003.pt") == on_disk.read_bytes()  # streamed whole, byte for byte
    assert manifest["pruned_versions"] == [[1, 1]] and [v["version"] for v in manifest["versions"]] == [0, 2, 3]
    with pytest.raises(NotFound, match="pruned"):
        keep2.evaluate(episodes=1, version=1)
    with pytest.raises(LimitExceeded, match="max_storage_bytes=1"):
        env["t"]["store1"].rl(updates=1)
    # max_queued_ops=1: of concurrent calls, the ones beyond the first are refused with 429 + Retry-After, a
    # budget of calls at once, not a quota (optim_step without a forward_backward is itself refused, so nothing
    # changes either way)
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: api("POST", "/v1/tenants/q1/optim_step", "q1"), range(8)))
    classes = {_error(r)[0] for r in codes}
    assert "Overloaded" in classes and classes <= {"Overloaded", "Conflict"}
    refused = [r for r in codes if _error(r)[0] == "Overloaded"]
    assert all(r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert any("max_queued_ops=1" in _error(r)[1] for r in refused)


def test_reconnect_with_a_tenant_token(env):
    """The README's flow: keep the token, connect to the gateway with it, see and drive only your tenant."""
    url, token = env["nx"].service.gateway_url, env["t"]["a"].token
    with Nexus(url, token=token) as mine:
        assert [t["tenant"] for t in mine.status()["tenants"]] == ["a"]
        a = mine.tenant("a")
        out = a.predict_action(Observation(state=np.zeros(35, np.float32))).result(60)
        assert out["action"].shape == (4,)
        with pytest.raises(Forbidden):
            Tenant(mine, "b", {}).forward_backward(_batch(2)).result(60)
        with pytest.raises(NotFound):
            mine.tenant("b")


# -- fuzzing --------------------------------------------------------------------------------------
FIELDS = ("name", "env", "dataset", "action_dim", "action_head", "chunk", "hidden_dim", "init_log_std", "lr",
          "weight_decay", "grad_clip", "priority", "max_inflight", "max_staleness", "seed", "output_dir")
junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                    max_leaves=6)


def _numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


# every value below is invalid for its field (pydantic's lax mode would take "5" or 5.0 for an int: excluded)
words = st.text(max_size=4).filter(lambda s: not _numeric(s))
not_int_in = lambda lo, hi: st.floats(allow_nan=True).filter(  # noqa: E731
    lambda f: not math.isfinite(f) or f != int(f) or not lo <= f <= hi)
invalid_value = {
    "name": st.text(max_size=50).filter(lambda s: not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,39}", s))
    | st.integers() | st.none(),
    "env": st.text(max_size=30) | st.integers(),
    "action_dim": st.integers(max_value=0) | st.integers(min_value=5) | words,
    "action_head": st.text(max_size=8).filter(lambda s: s not in ("oft", "groot", "pi")),
    "chunk": st.integers(max_value=0) | st.integers(min_value=65),
    "hidden_dim": st.integers(max_value=7) | st.integers(min_value=4097) | not_int_in(8, 4096) | words,
    "lr": st.floats(max_value=0) | st.just(float("inf")) | st.just(float("nan")) | words,
    "seed": st.integers(max_value=-1) | st.integers(min_value=601) | not_int_in(0, 600),
    "max_inflight": st.integers(max_value=0) | st.integers(min_value=9),
    "priority": st.integers(min_value=11) | st.integers(max_value=-11),
    "output_dir": st.text(min_size=1, max_size=30),
    "init_log_std": st.just(float("nan")) | st.just(float("-inf")) | words,
}
specs = st.one_of(
    st.fixed_dictionaries({"name": st.from_regex(r"fz[a-z0-9]{1,8}", fullmatch=True), "env": st.just(PUSH)}).flatmap(
        lambda base: st.sampled_from(sorted(invalid_value)).flatmap(
            lambda k: invalid_value[k].map(lambda v: {**base, k: v}))),
    st.dictionaries(st.text(max_size=8).filter(lambda k: k not in FIELDS), junk, min_size=1, max_size=3).map(
        lambda extra: {"name": "fzextra", "env": PUSH, **extra}),
    junk.filter(lambda x: not isinstance(x, dict)),
)
bad_states = (st.lists(st.floats(-1, 1), max_size=34) | st.lists(st.floats(-1, 1), min_size=36, max_size=40)
              | st.lists(st.just(float("nan")) | st.just(float("inf")), min_size=35, max_size=35)
              | st.lists(st.text(max_size=2), min_size=35, max_size=35) | st.none() | st.text(max_size=10)
              | st.lists(st.lists(st.floats(-1, 1), min_size=1, max_size=2), min_size=35, max_size=35))
observations = st.one_of(
    bad_states.map(lambda s: {"state": s}),
    st.dictionaries(st.text(min_size=1, max_size=6), junk, max_size=2).map(
        lambda imgs: {"state": [0.0] * 35, "images": imgs or {"cam": 1}}),
    st.dictionaries(st.text(max_size=8).filter(lambda k: k not in ("state", "images", "instruction")), junk,
                    min_size=1, max_size=2).map(lambda extra: {"state": [0.0] * 35, **extra}),
    (st.integers() | st.floats() | st.lists(junk, max_size=3)).map(lambda i: {"state": [0.0] * 35, "instruction": i}),
)


def _fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.filter_too_much])


def test_fuzz_specs_observations_batches_never_500_never_a_change(env):
    api = env["api"]
    before = snapshot(env)
    seen: dict[int, int] = {}

    def refused(r: httpx.Response) -> None:
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert 400 <= r.status_code < 500, r.text
        assert _error(r)[0] in {"SpecError", "LimitExceeded", "Forbidden", "NotFound", "Conflict"}, r.text

    @_fuzz_settings(80)
    @given(specs)
    def fuzz_spec(spec):
        refused(api("POST", T, "op", content=json.dumps(spec).encode(), headers={"Content-Type": "application/json"}))

    @_fuzz_settings(60)
    @given(observations, st.booleans())
    def fuzz_observation(obs, via_batch):
        if via_batch:
            body = {"batch": {"observations": [obs], "actions": [[0.0] * 4]}}
            refused(api("POST", FB, "a", content=json.dumps(body).encode(),
                        headers={"Content-Type": "application/json"}))
        else:
            refused(api("POST", PRED, "a", content=json.dumps({"observation": obs}).encode(),
                        headers={"Content-Type": "application/json"}))

    fuzz_spec()
    fuzz_observation()
    assert snapshot(env) == before
    assert 422 in seen and sum(seen.values()) >= 140
