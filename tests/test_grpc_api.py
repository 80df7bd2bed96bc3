"""The gateway's gRPC robot API (``joynexus.v1.RobotPolicy``) against one live service (real Dask, engines, gRPC on
loopback):

* the committed stubs are what grpcio-tools makes of the ``.proto``;
* an ``Act`` stream answers what an HTTP predict answers for the same observation (the same path), camera
  tenants and chunked heads included, with its timing; many tenants' streams at once;
* tokens: none, unknown, another tenant's, the operator's on an unknown tenant;
* bad input — malformed protobuf, wrong shapes, dtypes and byte counts, unknown cameras, a message over
  ``limits.max_request_bytes``, a client that stops reading — each a clear status, the stream closed, another
  tenant's open stream answering as before, nothing changed in the service;
* ``UploadEpisodes``: a robot's episodes (acted on the stream) train its tenant's RL job; bad uploads refused;
* LeRobot's ``AsyncInference`` is not served; ``examples/grpc_robot.py`` runs.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.client.grpc_robot import RobotClient, grpc_target, observation
from nexus.errors import (
    Conflict,
    Forbidden,
    LimitExceeded,
    NexusError,
    NotFound,
    Overloaded,
    SpecError,
    Unauthorized,
    Unavailable,
)
from nexus.gateway.grpc_api import SERVICE, deadline_of, status_of, to_array, to_tensor
from nexus.gateway.proto import nexus_robot_pb2 as pb
from nexus.spec import TenantSpec
from nexus.wire.inputs import encode_array

REPO = Path(__file__).resolve().parent.parent
PUSH = "maniskill/pushcube-state"
RGB = "maniskill/pickcube-rgb"
MAX_BYTES = 2**18
Code = grpc.StatusCode


# -- without a service --------------------------------------------------------------------------
def test_committed_stubs_are_what_grpcio_tools_makes_of_the_proto(tmp_path):
    proto = "nexus/gateway/proto/nexus_robot.proto"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", proto], cwd=REPO, check=True)
    for name in ("nexus_robot_pb2.py", "nexus_robot_pb2_grpc.py"):
        fresh = (tmp_path / "nexus/gateway/proto" / name).read_text()
        assert fresh == (REPO / "nexus/gateway/proto" / name).read_text(), f"{name}: regenerate it (see the .proto)"


def test_every_refusal_has_its_status():
    assert status_of(SpecError("x")) == Code.INVALID_ARGUMENT
    assert status_of(LimitExceeded("x")) == Code.RESOURCE_EXHAUSTED
    assert status_of(Unauthorized("x")) == Code.UNAUTHENTICATED
    assert status_of(Forbidden("x")) == Code.PERMISSION_DENIED
    assert status_of(NotFound("x")) == Code.NOT_FOUND
    assert status_of(Conflict("x")) == Code.FAILED_PRECONDITION
    assert status_of(Overloaded("x", 0.5)) == Code.RESOURCE_EXHAUSTED
    assert status_of(Unavailable("x")) == Code.UNAVAILABLE
    assert status_of(NexusError("x")) == Code.INVALID_ARGUMENT


def test_tensors_round_trip_and_bad_ones_are_refused():
    for a in (np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((2, 5, 3), np.uint8), np.arange(3)):
        back = to_array(to_tensor(a), "x")
        assert back.dtype == a.dtype and np.array_equal(back, a)
    with pytest.raises(SpecError, match="dtype 'float16'"):
        to_array(pb.Tensor(data=b"\0\0", dtype="float16", shape=[1]), "obs.state")
    with pytest.raises(SpecError, match="obs.state: 7 bytes do not fit shape"):
        to_array(pb.Tensor(data=b"\0" * 7, dtype="float32", shape=[2]), "obs.state")
    with pytest.raises(SpecError, match="not a shape"):
        to_array(pb.Tensor(data=b"", dtype="uint8", shape=[-1]), "obs.state")


# -- against a service --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc")
    with Nexus.local(root, n_sim=1, grpc_port=0, limits={"max_request_bytes": MAX_BYTES},
                     tenant_limits={"slow": {"max_inflight_predicts": 1}},
                     datapath={"producer_lease_s": 300}) as nx:
        t = {s.name: nx.create_tenant(s) for s in (
            TenantSpec(name="a", env=PUSH, seed=2),
            TenantSpec(name="b", env=PUSH, seed=3),
            TenantSpec(name="cam", env=RGB, chunk=4, seed=4),
            TenantSpec(name="slow", env=PUSH, seed=5),
            TenantSpec(name="robot", env=PUSH, seed=6))}
        target = grpc_target(nx.service.config.gateway_dir)
        assert target is not None and target.startswith("127.0.0.1:")
        yield {"nx": nx, "t": t, "target": target, "op": nx.service.operator_token,
               "url": nx.service.gateway_url}


def _state(seed: int, d: int = 35) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, d).astype(np.float32)


def _http_predict(svc, tenant: str, obs: dict) -> dict:
    body = {"observation": {k: encode_array(v) if k == "state" else
                            {c: encode_array(i) for c, i in v.items()} for k, v in obs.items()}}
    r = httpx.post(f"{svc['url']}/v1/tenants/{tenant}/predict", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {svc['t'][tenant].token}"})
    assert r.status_code == 200, r.text
    return r.json()


def _raw_act(svc, token: str | None, frames: list[bytes]) -> tuple[list[bytes], grpc.RpcError | None]:
    """Raw bytes on an Act stream (what a hostile client sends) -> the replies before the error, the error."""
    with grpc.insecure_channel(svc["target"], options=[("grpc.max_send_message_length", 8 * MAX_BYTES)]) as ch:
        call = ch.stream_stream(f"/{SERVICE}/Act")(iter(frames), timeout=120,
                                                  metadata=(("authorization", f"Bearer {token}"),) if token else ())
        got = []
        try:
            for r in call:
                got.append(r)
        except grpc.RpcError as e:
            return got, e
        return got, None


def _obs_bytes(tenant: str, state, **fields) -> bytes:
    return observation(tenant, {"state": state}, **fields).SerializeToString()


@pytest.mark.cluster
def test_a_stream_answers_as_http_predict_and_tells_its_times(svc):
    with RobotClient(svc["target"], svc["t"]["a"].token) as client:
        info = client.info("a")
        assert info["action_dim"] == 4 and info["proprio_dim"] == 35 and info["chunk"] == 1 and info["cameras"] == []
        with client.session("a") as s:
            for i in range(3):
                out = s.act({"state": _state(i)}, deadline_ms=60_000)
                ref = _http_predict(svc, "a", {"state": _state(i)})
                assert out["actions"].shape == (1, 4)
                assert np.allclose(out["actions"][0], ref["action"], atol=1e-5)
                assert out["version"] == ref["version"] == info["version"]
                assert out["request_id"] == i + 1 and not out["deadline_missed"]
                tm = out["timing"]
                assert 0 < tm["forward_ms"] <= tm["total_ms"] and 0 <= tm["queue_ms"] <= tm["total_ms"]
            sampled = s.act({"state": _state(0)}, sample=True, seed=7)
            again = s.act({"state": _state(0)}, sample=True, seed=7)
            assert np.array_equal(sampled["actions"], again["actions"]) and sampled["logprob"] == again["logprob"]


def test_an_observations_deadline_is_the_earlier_of_its_field_and_the_calls():
    assert deadline_of(0.0, None, 0.01) is None
    assert deadline_of(80.0, None, 0.01) == 80.0
    assert deadline_of(80.0, 0.04, 0.01) == pytest.approx(50.0)  # the call's, counted from the arrival, is earlier
    assert deadline_of(0.0, 2.0, 0.0) == pytest.approx(2000.0)
    assert deadline_of(30.0, 2.0, 0.01) == 30.0
    assert deadline_of(0.0, -1.0, 0.01) == 0.0  # the call's deadline passed already: due now
    for bad in (-1.0, float("nan"), float("inf"), 600_001.0):
        with pytest.raises(SpecError, match="deadline_ms"):
            deadline_of(bad, None, 0.0)


@pytest.mark.cluster
def test_the_inference_queue_honours_a_grpc_deadline(svc):
    """A group held open (T = 60 s, a producer that is not waiting: neither 'all waiting' nor a full group fires
    it; its lease, ``datapath.producer_lease_s``, outlasts the test) starts for a gRPC observation's deadline.
    Without it the observation would wait the whole T and its group fire for the timeout."""
    eng, cfg = svc["nx"].service.engine(0), svc["nx"].service.config
    eng.set_batching(60.0, 64).result(60)
    try:
        eng.open_producer("stepping-sim").result(60)
        eng.reset_stats().result(60)
        with RobotClient(svc["target"], svc["t"]["a"].token) as client, client.session("a") as s:
            out = s.act({"state": _state(0)}, deadline_ms=300)
            assert out["actions"].shape == (1, 4) and out["timing"]["deadline_ms"] == 300
        fired = eng.engine_stats().result(60)["reasons"]
        assert fired == {"deadline": 1}, fired
    finally:
        eng.set_batching(cfg.infer_max_wait_s, cfg.infer_max_batch).result(60)
        eng.close_producer("stepping-sim").result(60)
    # the stream's own gRPC deadline is an observation's deadline too (without deadline_ms)
    with RobotClient(svc["target"], svc["t"]["a"].token) as client, client.session("a", timeout=120) as s:
        out = s.act({"state": _state(1)})
        assert 0 < out["timing"]["deadline_ms"] <= 120_000 and not out["deadline_missed"]


@pytest.mark.cluster
def test_a_camera_tenant_gets_chunks_and_many_tenants_stream_at_once(svc):
    img = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with RobotClient(svc["target"], svc["t"]["cam"].token) as client:
        info = client.info("cam")
        assert info["chunk"] == 4 and info["cameras"] == [{"name": "base_camera", "height": 64, "width": 64}]
        cam_obs = {"state": _state(1, info["proprio_dim"]), "images": {"base_camera": img}}
        prefix = np.full((2, info["action_dim"]), 0.5, np.float32)  # real-time chunking: what the robot executed
        with client.session("cam") as s:
            out = s.act(cam_obs)
            rtc = s.act(cam_obs, executed_prefix=prefix)
        ref = _http_predict(svc, "cam", cam_obs)
        assert out["actions"].shape == rtc["actions"].shape == (4, info["action_dim"])
        assert np.allclose(out["actions"].reshape(-1), ref["chunk"], atol=1e-5)
        assert np.array_equal(rtc["actions"][:2], prefix)  # the oft head's rest: as without it
        assert np.allclose(rtc["actions"][2:], out["actions"][2:], atol=1e-5)

    results: dict[str, list] = {}

    def robot(tenant: str) -> None:
        with RobotClient(svc["target"], svc["t"][tenant].token) as c, c.session(tenant) as s:
            results[tenant] = [s.act({"state": _state(k)})["actions"] for k in range(5)]

    threads = [threading.Thread(target=robot, args=(t,)) for t in ("a", "b", "robot")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    for tenant in ("a", "b", "robot"):
        assert len(results[tenant]) == 5
        for k, got in enumerate(results[tenant]):
            assert np.allclose(got[0], _http_predict(svc, tenant, {"state": _state(k)})["action"], atol=1e-5)
    assert not np.allclose(results["a"][0], results["b"][0])  # each tenant its own policy


@pytest.mark.cluster
def test_tokens_reach_only_their_own_tenant(svc):
    good = _obs_bytes("b", _state(0))
    for token, code, phrase in ((None, Code.UNAUTHENTICATED, "no token"),
                                ("nxt_not-a-token", Code.UNAUTHENTICATED, "unknown token"),
                                (svc["t"]["a"].token, Code.PERMISSION_DENIED, "tenant 'b'")):
        got, err = _raw_act(svc, token, [good])
        assert got == [] and err is not None and err.code() == code and phrase in err.details()
        with RobotClient(svc["target"], token or "") as c, pytest.raises(grpc.RpcError) as e:
            c.info("b")
        assert e.value.code() == code
    got, err = _raw_act(svc, svc["op"], [_obs_bytes("nobody", _state(0))])
    assert err.code() == Code.NOT_FOUND and "nobody" in err.details()
    got, err = _raw_act(svc, svc["op"], [good])  # the operator reaches every tenant
    assert err is None and len(got) == 1


def _snapshot(svc) -> dict:
    st = svc["nx"].status()
    return {"tenants": {t["tenant"]: t["version"] for t in st["tenants"]}, "jobs": sorted(j["job"] for j in st["jobs"]
                                                                                       if j["tenant"] != "robot")}


BIG = np.zeros(MAX_BYTES // 4 + 1, np.float32)
BAD = [  # (name, frames, status, phrase of the message)
    ("not protobuf", [b"\xff\xff\xff\xff"], Code.INVALID_ARGUMENT, "not a valid joynexus.v1.Observation"),
    ("no tenant", [_obs_bytes("", _state(0))], Code.INVALID_ARGUMENT, "observation.tenant"),
    ("no state", [observation("a", {}).SerializeToString()], Code.INVALID_ARGUMENT, "observation.state: missing"),
    ("wrong state shape", [_obs_bytes("a", _state(0, 34))], Code.INVALID_ARGUMENT, "observation.state"),
    ("wrong dtype", [pb.Observation(tenant="a", state=pb.Tensor(data=b"\0" * 70, dtype="float16", shape=[35]))
                     .SerializeToString()], Code.INVALID_ARGUMENT, "dtype 'float16'"),
    ("bytes do not fit", [pb.Observation(tenant="a", state=pb.Tensor(data=b"\0" * 139, dtype="float32", shape=[35]))
                          .SerializeToString()], Code.INVALID_ARGUMENT, "139 bytes do not fit"),
    ("NaN state", [_obs_bytes("a", np.full(35, np.nan, np.float32))], Code.INVALID_ARGUMENT, "NaN"),
    ("unknown camera", [observation("a", {"state": _state(0), "images": {"wrist": np.zeros((4, 4, 3), np.uint8)}})
                        .SerializeToString()], Code.INVALID_ARGUMENT, "unknown camera"),
    ("seed without sample", [_obs_bytes("a", _state(0), seed=3)], Code.INVALID_ARGUMENT, "sample"),
    ("bad prefix", [_obs_bytes("a", _state(0), executed_prefix=np.zeros((1, 3), np.float32))],
     Code.INVALID_ARGUMENT, "executed_prefix"),
    ("prefix longer than the chunk", [_obs_bytes("a", _state(0), executed_prefix=np.zeros((2, 4), np.float32))],
     Code.INVALID_ARGUMENT, "1 <= k <= 1"),
    ("negative deadline", [_obs_bytes("a", _state(0), deadline_ms=-1.0)], Code.INVALID_ARGUMENT, "deadline_ms"),
    ("unknown version", [_obs_bytes("a", _state(0), version=999)], Code.NOT_FOUND, "999"),
    ("over the size limit", [_obs_bytes("a", BIG)], Code.RESOURCE_EXHAUSTED, ""),
    ("good, then bad", [_obs_bytes("a", _state(0)), b"\x0a"], Code.INVALID_ARGUMENT, "not a valid"),
]


@pytest.mark.cluster
@pytest.mark.parametrize("name,frames,code,phrase", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_status_and_disturbs_nothing(svc, name, frames, code, phrase):
    before = _snapshot(svc)
    with RobotClient(svc["target"], svc["t"]["b"].token) as c, c.session("b") as watcher:
        ref = watcher.act({"state": _state(5)})
        got, err = _raw_act(svc, svc["t"]["a"].token, frames)
        assert err is not None and err.code() == code, (name, err)
        assert phrase in err.details()
        assert len(got) == (1 if name == "good, then bad" else 0)
        after = watcher.act({"state": _state(5)})  # the other tenant's open stream answers as before
        assert np.array_equal(after["actions"], ref["actions"]) and after["version"] == ref["version"]
    assert _snapshot(svc) == before
    got, err = _raw_act(svc, svc["t"]["a"].token, [_obs_bytes("a", _state(0))])  # the tenant itself goes on
    assert err is None and len(got) == 1


@pytest.mark.cluster
def test_a_client_that_stops_reading_holds_nobody_up(svc):
    tok = svc["t"]["slow"].token
    refs = [_http_predict(svc, "b", {"state": _state(k)})["action"] for k in range(5)]
    stalled = RobotClient(svc["target"], tok)
    s = stalled.session("slow")
    for k in range(40):  # sent, never read
        s.send({"state": _state(k)})
    try:
        with RobotClient(svc["target"], svc["t"]["b"].token) as c, c.session("b") as other:
            for k in range(5):
                out = other.act({"state": _state(k)})
                assert np.allclose(out["actions"][0], refs[k], atol=1e-5)
    finally:
        s.close()
        stalled.close()
    # the closed stream's predicts end and give their budget (max_inflight_predicts = 1) back
    for _ in range(600):
        r = httpx.get(f"{svc['url']}/v1/admin/qos", headers={"Authorization": f"Bearer {svc['op']}"}, timeout=60)
        if r.json()["inflight"] == {}:
            break
        time.sleep(0.1)
    assert r.json()["inflight"] == {}
    with RobotClient(svc["target"], tok) as c, c.session("slow") as again:
        assert again.act({"state": _state(0)})["actions"].shape == (1, 4)


@pytest.mark.cluster
def test_a_token_revoked_mid_stream_stops_working(svc):
    t = svc["nx"].create_tenant(TenantSpec(name="gone", env=PUSH, seed=9))
    with RobotClient(svc["target"], t.token) as c, c.session("gone") as s:
        assert s.act({"state": _state(0)})["actions"].shape == (1, 4)
        r = httpx.delete(f"{svc['url']}/v1/tenants/gone", headers={"Authorization": f"Bearer {t.token}"}, timeout=120)
        assert r.status_code == 200, r.text
        with pytest.raises(grpc.RpcError) as e:
            s.act({"state": _state(0)})
        assert e.value.code() == Code.UNAUTHENTICATED


@pytest.mark.cluster
def test_lerobot_async_inference_is_not_served(svc):
    with grpc.insecure_channel(svc["target"]) as ch, pytest.raises(grpc.RpcError) as e:
        ch.unary_unary("/async_inference.AsyncInference/Ready")(b"", timeout=60,
                                                                metadata=(("authorization", f"Bearer {svc['op']}"),))
    assert e.value.code() == Code.UNIMPLEMENTED


def _episodes(session, steps: int = 6) -> dict:
    """Two episodes acted on the stream (samples), as the upload's columns."""
    from nexus.client.rollouts import EpisodeBuffer

    buf = EpisodeBuffer()
    for k in range(steps):
        state = _state(100 + k)
        out = session.act({"state": state}, sample=True)
        buf.add({"state": state}, {"action": out["actions"][0], "logprob": out["logprob"], "value": out["value"],
                                   "version": out["version"]}, reward=float(k % 3), terminated=False,
                truncated=k in (steps // 2 - 1, steps - 1))
    return buf.columns()


@pytest.mark.cluster
def test_a_robots_episodes_train_its_tenants_rl_job(svc):
    t = svc["t"]["robot"]
    job = t.rl(updates=1, rollouts="external")
    with RobotClient(svc["target"], t.token) as client, client.session("robot") as s:
        cols = _episodes(s)
        for bad, code, phrase in (
                ({**cols, "reward": cols["reward"][:-1]}, Code.INVALID_ARGUMENT, "episodes.reward"),
                ({k: v for k, v in cols.items() if k != "logprob"}, Code.INVALID_ARGUMENT, "missing ['logprob']"),
                ({**cols, "policy_version": cols["policy_version"] + 50}, Code.INVALID_ARGUMENT, "policy_version"),
                ({**cols, "terminated": np.zeros(6, np.int32), "truncated": np.zeros(6, np.int32)},
                 Code.INVALID_ARGUMENT, "whole episodes")):
            with pytest.raises(grpc.RpcError) as e:
                client.upload(job.id, bad)
            assert e.value.code() == code and phrase in e.value.details(), e.value.details()
        with RobotClient(svc["target"], svc["t"]["a"].token) as other, pytest.raises(grpc.RpcError) as e:
            other.upload(job.id, cols)  # another tenant's job is as unknown as a missing one
        assert e.value.code() == Code.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            client.upload("no-such-job", cols)
        assert e.value.code() == Code.NOT_FOUND
        out = client.upload(job.id, cols)
        assert out["accepted"] and out["rows"] == 6 and out["episodes"] == 2 and out["policy_version"] == 0
    result = job.result(timeout=600)
    assert result["updates"] == 1 and result["uploads"] == 1 and result["dropped_stale"] == 0
    with RobotClient(svc["target"], t.token) as client, client.session("robot") as s:
        assert client.info("robot")["version"] == s.act({"state": _state(0)})["version"] == 1
        with pytest.raises(grpc.RpcError) as e:  # the job ended: it takes no more episodes
            client.upload(job.id, _episodes(s))
        assert e.value.code() == Code.FAILED_PRECONDITION


@pytest.mark.cluster
def test_the_grpc_robot_example_runs(svc):
    spec = importlib.util.spec_from_file_location("example_grpc_robot", REPO / "examples" / "grpc_robot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = svc["t"]["robot"]
    job = t.rl(updates=1, rollouts="external")
    out = mod.run(svc["target"], t.token, "robot", job.id, PUSH, steps=8, episode_steps=4, max_uploads=1)
    assert out["episodes"] >= 2 and out["uploads"] == 1 and 1 <= out["uploaded_rows"] <= 4
    assert job.result(timeout=600)["updates"] == 1
    json.dumps(out)


def test_the_listener_serves_tls_with_the_gateways_certificate(tmp_path):
    """A TLS gateway's gRPC listener: a client verifying the service CA gets the service's own answers (here its
    token check), a client without TLS gets no answer at all."""
    import asyncio

    from nexus.config.service import ServiceConfig
    from nexus.deploy.tls import ensure_certificates, server_certificate
    from nexus.gateway import grpc_api
    from nexus.gateway.app import Gateway
    from nexus.gateway.auth import TokenStore
    from nexus.gateway.backend import Backend

    config = ServiceConfig(root=str(tmp_path))
    ensure_certificates(config.tls_dir)
    cert, key = server_certificate(config.tls_dir, "gateway", ("127.0.0.1",))
    gw = Gateway(config, Backend("tls://127.0.0.1:1"), TokenStore(config.gateway_dir))  # never connected: not needed
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict = {}

    async def serve() -> None:
        box["stop"] = asyncio.Event()
        server, box["port"] = await grpc_api.start(gw, None, "127.0.0.1", 0, MAX_BYTES, str(cert), str(key))
        ready.set()
        await box["stop"].wait()
        await server.stop(0)

    th = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    th.start()
    try:
        assert ready.wait(60)
        target = f"127.0.0.1:{box['port']}"
        with RobotClient(target, "nxt_not-a-token", ca=config.tls_dir / "ca.pem") as c, \
                pytest.raises(grpc.RpcError) as e:
            c.info("a")
        assert e.value.code() == Code.UNAUTHENTICATED and "unknown token" in e.value.details()
        with RobotClient(target, "nxt_not-a-token") as c, pytest.raises(grpc.RpcError) as e:
            c.info("a", timeout=10)
        assert e.value.code() == Code.UNAVAILABLE
    finally:
        if "stop" in box:
            loop.call_soon_threadsafe(box["stop"].set)
        th.join(60)
        assert not th.is_alive()
        loop.close()
