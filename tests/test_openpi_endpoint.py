"""Robots on openpi's protocol against one live service (real Dask, engine, gateway, WebSocket on loopback).

``openpi-client`` 0.1.2, unmodified (``WebsocketClientPolicy(host, port, api_key=token).infer(obs)``), drives a
camera tenant's chunked policy and a state tenant's: the same actions as the HTTP predict of the same
observation and version, a batch frame, a deadline, a version pinned per connection; a token reaches only its
own tenant; a wrong or missing key is refused at the handshake; every bad frame is answered with an error frame
(the client raises it) and its connection closed, while another robot's replies stay what they were; a client
that stops reading holds at most one predict.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import httpx
import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from nexus.client.api import Nexus
from nexus.client.rollouts import EpisodeBuffer
from nexus.gateway.openpi import openpi_address
from nexus.spec import TenantSpec
from nexus.wire.inputs import encode_array

pytestmark = pytest.mark.cluster

LIMIT = 1 << 20  # limits.max_request_bytes of this service


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    root = tmp_path_factory.mktemp("openpi")
    with Nexus.local(root, n_sim=1, limits={"max_request_bytes": LIMIT}, openpi={"max_connections": 3}) as nx:
        t = {"cam": nx.create_tenant(TenantSpec(name="cam", env="maniskill/pickcube-rgb", chunk=4, seed=1)),
             "st": nx.create_tenant(TenantSpec(name="st", env="maniskill/pushcube-state", seed=2)),
             "flow": nx.create_tenant(TenantSpec(name="flow", env="maniskill/pickcube-rgb", chunk=4, seed=3,
                                                 action_head="pi")),
             "rl": nx.create_tenant(TenantSpec(name="rl", env="maniskill/pushcube-state", seed=4, max_staleness=0))}
        url = openpi_address(nx.service.config.gateway_dir)
        assert url is not None and url.startswith("ws://127.0.0.1:")
        host, port = url.removeprefix("ws://").rsplit(":", 1)
        yield {"nx": nx, "t": t, "host": host, "port": int(port), "url": url}


def cam_obs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"observation/image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
            "observation/state": rng.standard_normal(29).astype(np.float32),
            "prompt": "pick up the red cube"}


def st_obs(seed: int) -> dict:
    return {"observation/state": np.random.default_rng(seed).standard_normal(35).astype(np.float32)}


def http_predict(svc, tenant: str, obs: dict, version: int, status: int = 200, **extra) -> dict:
    wire = {"state": encode_array(obs["observation/state"])}
    if "observation/image" in obs:
        wire["images"] = {"base_camera": encode_array(obs["observation/image"])}
    if "prompt" in obs:
        wire["instruction"] = obs["prompt"]
    r = httpx.post(f"{svc['nx'].service.gateway_url}/v1/tenants/{tenant}/predict", timeout=120,
                   json={"observation": wire, "version": version, **extra},
                   headers={"Authorization": f"Bearer {svc['t'][tenant].token}"})
    assert r.status_code == status, r.text
    return r.json()


def test_openpi_client_drives_the_tenants_policy_as_http_predict(svc):
    robot = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["cam"].token)
    meta = robot.get_server_metadata()
    assert meta["tenant"] == "cam" and meta["action_dim"] == 4 and meta["action_horizon"] == 4
    assert meta["state_dim"] == 29 and meta["cameras"] == [{"name": "base_camera", "height": 64, "width": 64}]
    assert meta["observation_keys"] == {"observation/image": "images.base_camera", "observation/state": "state",
                                        "prompt": "instruction"}
    assert isinstance(meta["version"], int)
    for seed in range(3):
        obs = cam_obs(seed)
        out = robot.infer(obs)
        assert out["actions"].shape == (4, 4) and out["actions"].dtype == np.float32
        assert out["version"] == meta["version"]
        timing = out["server_timing"]
        assert {"decode_ms", "queue_ms", "forward_ms", "total_ms", "infer_ms"} <= set(timing)
        assert timing["total_ms"] >= timing["forward_ms"] > 0
        ref = http_predict(svc, "cam", obs, meta["version"])
        np.testing.assert_allclose(out["actions"], np.asarray(ref["chunk"], np.float32).reshape(4, 4),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["actions"][0], ref["action"], rtol=1e-5, atol=1e-6)
    # CHW images (openpi's ALOHA layout) are read as HWC
    obs = cam_obs(7)
    chw = {**obs, "observation/image": obs["observation/image"].transpose(2, 0, 1).copy()}
    np.testing.assert_allclose(robot.infer(chw)["actions"], robot.infer(obs)["actions"], rtol=1e-5, atol=1e-6)

    # a state-only tenant: horizon 1
    st = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["st"].token)
    assert st.get_server_metadata()["observation_keys"] == {"observation/state": "state", "prompt": "instruction"}
    out = st.infer(st_obs(1))
    assert out["actions"].shape == (1, 4)
    ref = http_predict(svc, "st", st_obs(1), st.get_server_metadata()["version"])
    np.testing.assert_allclose(out["actions"][0], ref["action"], rtol=1e-5, atol=1e-6)
    # an HTTP predict carries a deadline too
    timed = http_predict(svc, "st", st_obs(1), st.get_server_metadata()["version"], deadline_ms=500)
    np.testing.assert_allclose(timed["action"], ref["action"], rtol=1e-5, atol=1e-6)
    assert "deadline_ms" in http_predict(svc, "st", st_obs(1), 0, status=422, deadline_ms=0)["error"]["message"]
    robot._ws.close()
    st._ws.close()


def test_batch_deadline_version_and_health(svc):
    robot = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["cam"].token)
    obs = [cam_obs(10 + i) for i in range(3)]
    out = robot.infer({"batch": obs, "deadline_ms": 250})
    assert out["actions"].shape == (3, 4, 4) and len(out["versions"]) == 3
    assert out["server_timing"]["deadline_ms"] == 250
    for i, o in enumerate(obs):
        np.testing.assert_allclose(out["actions"][i], robot.infer(o)["actions"], rtol=1e-5, atol=1e-6)
    # a config frame: a per-connection deadline and another key map, answered with the new metadata
    meta = robot.infer({"config": {"deadline_ms": 100, "keys": {"front": "images.base_camera",
                                                                 "joints": "state", "prompt": "instruction"}}})
    assert meta["deadline_ms"] == 100 and meta["required_keys"] == ["front", "joints"]
    o = obs[0]
    got = robot.infer({"front": o["observation/image"], "joints": o["observation/state"], "prompt": o["prompt"]})
    assert got["server_timing"]["deadline_ms"] == 100
    np.testing.assert_allclose(got["actions"], out["actions"][0], rtol=1e-5, atol=1e-6)
    robot._ws.close()

    # the query pins a version: one the engine does not serve is an error frame; 'live' follows training
    live = WebsocketClientPolicy(f"{svc['url']}/?version=live&deadline_ms=80", api_key=svc["t"]["st"].token)
    assert live.get_server_metadata()["version"] == "live" and live.get_server_metadata()["deadline_ms"] == 80
    assert live.infer(st_obs(2))["actions"].shape == (1, 4)
    old = WebsocketClientPolicy(f"{svc['url']}/?version=99", api_key=svc["t"]["st"].token)
    with pytest.raises(RuntimeError, match="version 99 of tenant 'st' is neither live nor pinned"):
        old.infer(st_obs(2))
    live._ws.close()

    with urllib.request.urlopen(f"http://{svc['host']}:{svc['port']}/healthz", timeout=30) as r:
        assert r.status == 200


def test_real_time_chunking_starts_the_chunk_with_the_executed_prefix(svc):
    """A robot sends the actions of its previous chunk it executed (``executed_prefix``, [k, action_dim]): the
    reply's first k actions are them; a flow head (pi) plans the rest after them (inpainted while denoising),
    the oft head decodes its positions independently (the rest as without the prefix). The same over HTTP."""
    obs = cam_obs(21)
    prefix = np.array([[0.5, -0.5, 0.25, 0.0], [0.4, -0.4, 0.2, 0.1]], np.float32)
    for tenant, conditions in (("flow", True), ("cam", False)):
        robot = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"][tenant].token)
        plain = robot.infer(obs)["actions"]
        rtc = robot.infer({**obs, "executed_prefix": prefix})["actions"]
        assert rtc.shape == plain.shape == (4, 4)
        np.testing.assert_array_equal(rtc[:2], prefix)
        assert not np.allclose(plain[:2], prefix)
        if conditions:  # the rest re-planned after the prefix
            assert np.abs(rtc[2:] - plain[2:]).max() > 1e-6, (tenant, rtc, plain)
        else:
            np.testing.assert_allclose(rtc[2:], plain[2:], rtol=1e-5, atol=1e-6)
        # a whole chunk executed: the chunk is the prefix; one action: only it is fixed
        full = np.tile(prefix[:1], (4, 1))
        np.testing.assert_array_equal(robot.infer({**obs, "executed_prefix": full})["actions"], full)
        np.testing.assert_array_equal(robot.infer({**obs, "executed_prefix": prefix[:1]})["actions"][0], prefix[0])
        # in a batch frame, per observation
        both = robot.infer({"batch": [obs, {**obs, "executed_prefix": prefix}]})["actions"]
        np.testing.assert_allclose(both[0], plain, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(both[1], rtc, rtol=1e-5, atol=1e-6)
        # HTTP: the same chunk
        version = robot.get_server_metadata()["version"]
        ref = http_predict(svc, tenant, obs, version, executed_prefix=prefix.tolist())
        np.testing.assert_allclose(np.asarray(ref["chunk"], np.float32).reshape(4, 4), rtc, rtol=1e-5, atol=1e-6)
        robot._ws.close()
    # refused: longer than the chunk, a sample of the oft head (its logprob would not be the chunk's)
    bad = http_predict(svc, "cam", obs, 0, status=422, executed_prefix=np.zeros((5, 4)).tolist())
    assert "1 <= k <= 4" in bad["error"]["message"]
    bad = http_predict(svc, "cam", obs, 0, status=422, executed_prefix=prefix.tolist(), deterministic=False)
    assert "deterministic" in bad["error"]["message"]


def _acted_episodes(robot, steps: int = 6) -> dict:
    """Two episodes acted over openpi with samples (``sample``: the reply's logprob and value), as upload columns."""
    buf = EpisodeBuffer()
    for k in range(steps):
        obs = st_obs(200 + k)
        out = robot.infer({**obs, "sample": True})
        buf.add({"state": obs["observation/state"]}, {"action": out["actions"][0], "logprob": out["logprob"],
                                                      "value": out["value"], "version": out["version"]},
                reward=float(k % 3), terminated=False, truncated=k in (steps // 2 - 1, steps - 1))
    return buf.columns()


def test_a_robots_episodes_train_its_tenants_rl_job_over_openpi(svc):
    """Episode frames ``{"episode": columns, "job": id}`` beside inference frames on one connection: stored
    and trained as HTTP uploads are, staleness included (max_staleness 0: a batch acted by the version before the
    live one is dropped); a bad upload is an error frame; another tenant's job is unknown."""
    t = svc["t"]["rl"]
    job = t.rl(updates=2, rollouts="external")
    robot = WebsocketClientPolicy(f"{svc['url']}/?version=live", api_key=t.token)
    cols = _acted_episodes(robot)
    assert len(set(cols["logprob"].tolist())) > 1 and set(cols["policy_version"].tolist()) == {0}
    out = robot.infer({"episode": cols, "job": job.id})["episode"]
    assert out["accepted"] and out["rows"] == 6 and out["episodes"] == 2 and out["policy_version"] == 0
    deadline = time.monotonic() + 300
    while svc["nx"].tenant("rl").version < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    stale = robot.infer({"episode": cols, "job": job.id})["episode"]  # acted by version 0, now 1 is live
    assert stale["policy_version"] == 0
    fresh = _acted_episodes(robot)
    assert set(fresh["policy_version"].tolist()) == {1}
    robot.infer({"episode": fresh, "job": job.id})
    res = job.result(timeout=300)
    assert (res["updates"], res["dropped_stale"], res["uploads"]) == (2, 1, 3), res
    robot._ws.close()
    for token, frame, phrase in (
            (t.token, {"episode": {**cols, "reward": cols["reward"][:-1]}, "job": job.id}, "episodes.reward"),
            (t.token, {"episode": cols}, "an episode frame is"),
            (t.token, {"episode": cols, "job": "no-such-job"}, "unknown job"),
            (svc["t"]["st"].token, {"episode": cols, "job": job.id}, "unknown job")):
        other = WebsocketClientPolicy(svc["host"], svc["port"], api_key=token)
        with pytest.raises(RuntimeError, match=phrase):
            other.infer(frame)
    assert svc["nx"].tenant("rl").version == 2  # nothing else trained


def test_tokens_reach_only_their_own_tenant(svc):
    for key in (None, "nxt_not-a-token", svc["t"]["cam"].token + "x"):
        with pytest.raises(InvalidStatus) as e:
            WebsocketClientPolicy(svc["host"], svc["port"], api_key=key)
        assert e.value.response.status_code == 401
    # st's token names its own tenant; asking for another one is refused before anything opens
    with pytest.raises(InvalidStatus) as e:
        WebsocketClientPolicy(f"{svc['url']}/?tenant=cam", api_key=svc["t"]["st"].token)
    assert e.value.response.status_code == 403 and b"tenant 'cam'" in e.value.response.body
    st = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["st"].token)
    assert st.get_server_metadata()["tenant"] == "st"
    with pytest.raises(RuntimeError, match="unknown key"):  # cam's observation is not st's
        st.infer(cam_obs(1))
    # the operator names the tenant
    op = WebsocketClientPolicy(f"{svc['url']}/?tenant=st", api_key=svc["nx"].service.operator_token)
    assert op.get_server_metadata()["tenant"] == "st" and op.infer(st_obs(3))["actions"].shape == (1, 4)
    # a tenant holds at most openpi.max_connections (3) at once
    assert wait_connections(svc, "st", 1)  # st's first was closed by its error frame: the operator's is open
    more = [WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["st"].token) for _ in range(2)]
    with pytest.raises(InvalidStatus) as e:
        WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["st"].token)
    assert e.value.response.status_code == 429 and b"openpi.max_connections" in e.value.response.body
    for c in (op, *more):
        c._ws.close()
    assert wait_connections(svc, "st", 0)


def wait_connections(svc, tenant: str, n: int, timeout_s: float = 60.0) -> bool:
    """Wait until the endpoint holds ``n`` open connections of ``tenant`` (a closed one is counted off once the
    server's side of its close handshake ends)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        qos = httpx.get(f"{svc['nx'].service.gateway_url}/v1/admin/qos", timeout=60,
                        headers={"Authorization": f"Bearer {svc['nx'].service.operator_token}"}).json()
        if qos["openpi"]["tenants"].get(tenant, 0) == n:
            return True
        time.sleep(0.05)
    return False


def _raw_array(data: bytes, dtype: str, shape: list[int]) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def _bad_frames() -> list[tuple[str, bytes | str, str]]:
    """(what, the frame as sent, a phrase of the error frame)."""
    good = cam_obs(3)
    img, state = good["observation/image"], good["observation/state"]

    def frame(**over) -> bytes:
        obs = {**good, **over}
        return msgpack_numpy.packb({k: v for k, v in obs.items() if v is not None})

    raw = {"observation/image": _raw_array(img.tobytes(), "|u1", [64, 64, 3]),
           "observation/state": _raw_array(state.tobytes(), "<f4", [29])}
    return [
        ("malformed msgpack", b"\xc1\x00garbage", "not a msgpack frame"),
        ("truncated msgpack", msgpack_numpy.packb(good)[:-10], "not a msgpack frame"),
        ("a text frame", "hello", "frames are binary msgpack"),
        ("not a dict", msgpack.packb([1, 2, 3]), "a frame is a dict"),
        ("unknown key", frame(**{"observation/extra": np.zeros(3)}), "unknown key(s) ['observation/extra']"),
        ("missing key", frame(**{"observation/image": None}), "missing key(s) ['observation/image']"),
        ("wrong state dim", frame(**{"observation/state": np.zeros(8, np.float32)}),
         "observation/state: expected 29 numbers"),
        ("wrong image shape", frame(**{"observation/image": np.zeros((224, 224, 3), np.uint8)}),
         "observation/image: expected shape (64, 64, 3)"),
        ("image values off uint8", frame(**{"observation/image": np.full((64, 64, 3), 300.0, np.float32)}),
         "expected uint8 values 0..255"),
        ("boolean state", frame(**{"observation/state": np.ones(29, bool)}), "booleans"),
        ("NaN state", frame(**{"observation/state": np.full(29, np.nan, np.float32)}), "NaN or infinite"),
        ("object dtype", msgpack.packb({**raw, "observation/state": _raw_array(b"\0" * 8 * 29, "|O", [29])}),
         "not a plain numeric dtype"),
        ("complex dtype", msgpack.packb({**raw, "observation/state": _raw_array(b"\0" * 8 * 29, "<c8", [29])}),
         "not a plain numeric dtype"),
        ("data short of its shape", msgpack.packb({**raw, "observation/state": _raw_array(b"\0" * 8, "<f4", [29])}),
         "does not fill shape [29]"),
        ("prompt not a string", frame(prompt=5), "prompt: expected a string"),
        ("bad deadline", msgpack_numpy.packb({**good, "deadline_ms": -5}), "deadline_ms: expected milliseconds"),
        ("prefix longer than the chunk", frame(executed_prefix=np.zeros((5, 4), np.float32)),
         "executed_prefix: expected [k, 4] numbers with 1 <= k <= 4"),
        ("prefix of the wrong action dim", frame(executed_prefix=np.zeros((2, 3), np.float32)),
         "executed_prefix: expected [k, 4]"),
        ("NaN prefix", frame(executed_prefix=np.full((2, 4), np.nan, np.float32)), "NaN or infinite"),
        ("empty batch", msgpack_numpy.packb({"batch": []}), "non-empty list"),
        ("batch over max_batch", msgpack_numpy.packb({"batch": [good] * 9}), "openpi.max_batch=8"),
        ("frame over the size limit", msgpack_numpy.packb({**good, "prompt": "x" * (LIMIT + 10)}),
         f"over the limit max_request_bytes={LIMIT}"),
    ]


def _other_robot(svc, results: list, stop: threading.Event) -> None:
    """Another tenant's robot sending the same observations over and over while the bad frames come."""
    robot = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["st"].token)
    try:
        while not stop.is_set():
            results.append([robot.infer(st_obs(s))["actions"] for s in range(3)])
    except Exception as e:  # the test fails on it
        results.append(e)
    finally:
        robot._ws.close()


def test_bad_frames_answered_with_an_error_frame_others_undisturbed(svc):
    ref = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["st"].token)
    expected = [ref.infer(st_obs(s))["actions"] for s in range(3)]
    ref._ws.close()
    results: list = []
    stop = threading.Event()
    other = threading.Thread(target=_other_robot, args=(svc, results, stop))
    other.start()
    try:
        headers = {"Authorization": f"Api-Key {svc['t']['cam'].token}"}
        for what, data, phrase in _bad_frames():
            with connect(svc["url"], additional_headers=headers, max_size=None, compression=None) as ws:
                msgpack_numpy.unpackb(ws.recv())  # metadata
                ws.send(data)
                answer = ws.recv()
                assert isinstance(answer, str), what
                assert phrase in answer, (what, answer)
                with pytest.raises(ConnectionClosed) as e:
                    ws.recv()
                assert e.value.rcvd is not None and e.value.rcvd.code == 1008, what
        # a frame over twice the limit is cut off at its header: closed with 1009, never read
        with connect(svc["url"], additional_headers=headers, max_size=None, compression=None) as ws:
            ws.recv()
            ws.send(b"\0" * (2 * LIMIT + 1))
            with pytest.raises(ConnectionClosed) as e:
                ws.recv()
            assert e.value.rcvd is not None and e.value.rcvd.code == 1009
        # the unmodified client raises the error frame
        robot = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["cam"].token)
        with pytest.raises(RuntimeError, match="Error in inference server:\nSpecError"):
            robot.infer({"observation/state": np.zeros(29, np.float32)})
        # the service goes on: a fresh connection of the same tenant is served
        robot = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["cam"].token)
        assert robot.infer(cam_obs(1))["actions"].shape == (4, 4)
        robot._ws.close()
    finally:
        stop.set()
        other.join(120)
    assert results and not [r for r in results if isinstance(r, Exception)], results[-1]
    for round_ in results:
        for got, want in zip(round_, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_client_that_stops_reading_holds_at_most_one_predict(svc):
    headers = {"Authorization": f"Api-Key {svc['t']['cam'].token}"}
    frame = msgpack_numpy.packb(cam_obs(4))
    stuck = connect(svc["url"], additional_headers=headers, max_size=None, compression=None, max_queue=1)
    try:
        for _ in range(40):  # never reads a reply
            stuck.send(frame)
        other = WebsocketClientPolicy(svc["host"], svc["port"], api_key=svc["t"]["st"].token)
        want = other.infer(st_obs(1))["actions"]
        for _ in range(5):
            np.testing.assert_allclose(other.infer(st_obs(1))["actions"], want, rtol=1e-5, atol=1e-6)
            qos = httpx.get(f"{svc['nx'].service.gateway_url}/v1/admin/qos", timeout=60,
                            headers={"Authorization": f"Bearer {svc['nx'].service.operator_token}"}).json()
            assert qos["inflight"].get("cam", 0) <= 1, json.dumps(qos["inflight"])
            assert qos["openpi"]["connections"] >= 2  # the stuck one is still open: only its own frame waits
        other._ws.close()
    finally:
        stuck.close_socket()
