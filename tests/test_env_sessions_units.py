"""The control plane's environment-session records as a plain object (no cluster): quotas counted with the
sessions being opened, placement on the least-loaded simulator worker, and the records following the workers'
heartbeats, a lost worker and a deleted tenant."""

from __future__ import annotations

import asyncio

import pytest

from nexus.config.service import ServiceLimits
from nexus.control.runtime import WorkerInfo
from nexus.control.tenants.env_sessions import EnvSessions
from nexus.control.tenants.registry import TenantPhase, TenantRegistry, TenantState
from nexus.errors import LimitExceeded, NotFound, SpecError, Unavailable
from nexus.features import TenantSchema
from nexus.spec import TenantSpec

PUSH = "maniskill/pushcube-state"


class Workers:
    """The two things the records need from Dask: the SIM workers, and their ``nexus_env_ctl`` handler."""

    def __init__(self, *addresses: str) -> None:
        self.sim = [WorkerInfo(f"sim-{i}", a, {"SIM": 1}) for i, a in enumerate(addresses)]
        self.calls: list[tuple[str, dict]] = []
        self.gate: asyncio.Event | None = None  # holds "open" calls until set
        self.spawned: list = []

    def workers(self, resource: str | None = None) -> list[WorkerInfo]:
        return list(self.sim)

    def worker_name(self, address: str) -> str | None:
        return next((w.name for w in self.sim if w.address == address), None)

    async def call(self, address: str, handler: str, timeout: float | None = 60.0, **msg) -> dict:
        self.calls.append((address, msg))
        if msg["action"] == "open" and self.gate is not None:
            await self.gate.wait()
        return {"session": msg["session"], "num_envs": msg.get("num_envs"), "closed": msg["action"] == "close"}

    def spawn(self, coro):
        self.spawned.append(asyncio.get_running_loop().create_task(coro))


def registry(*names: str) -> TenantRegistry:
    reg = TenantRegistry()
    for n in names:
        t = reg.add(TenantState(TenantSpec(name=n, env=PUSH), TenantSchema(35, 4), output_dir=f"/tmp/{n}"))
        t.move(TenantPhase.READY)
    return reg


def sessions(limits: ServiceLimits, *addresses: str, tenants=("a", "b")) -> tuple[EnvSessions, Workers]:
    w = Workers(*addresses)
    return EnvSessions(w, registry(*tenants), lambda _t: limits), w  # type: ignore[arg-type]


def test_quotas_count_sessions_being_opened_and_bad_requests_open_nothing():
    async def go():
        s, w = sessions(ServiceLimits(max_env_sessions=1, max_envs_per_session=4), "tcp://w0")
        w.gate = asyncio.Event()
        first = asyncio.create_task(s.open("a", PUSH, 2))
        await asyncio.sleep(0)
        with pytest.raises(LimitExceeded, match="max_env_sessions=1"):  # the first is still being built
            await s.open("a", PUSH, 1)
        w.gate.set()
        info = await first
        assert info["address"] == "tcp://w0" and info["worker"] == "sim-0"
        with pytest.raises(LimitExceeded, match="max_envs_per_session=4"):
            await s.open("b", PUSH, 5)
        with pytest.raises(SpecError, match="unknown env"):
            await s.open("b", "maniskill/nope", 1)
        with pytest.raises(SpecError, match="seed"):
            await s.open("b", PUSH, 2, seed=2**32 - 1)
        with pytest.raises(NotFound, match="unknown tenant"):
            await s.open("ghost", PUSH, 1)
        assert [m["action"] for _, m in w.calls] == ["open"] and len(s.sessions) == 1
    asyncio.run(go())


def test_sessions_go_to_the_least_loaded_simulator_worker_and_only_their_tenant_sees_them():
    async def go():
        s, w = sessions(ServiceLimits(), "tcp://w0", "tcp://w1")
        a1 = await s.open("a", PUSH, 4)
        a2 = await s.open("a", PUSH, 1)
        b1 = await s.open("b", PUSH, 2)
        assert (a1["address"], a2["address"], b1["address"]) == ("tcp://w0", "tcp://w1", "tcp://w1")
        assert s.load() == {"tcp://w0": 4, "tcp://w1": 3}
        with pytest.raises(NotFound):
            s.view("b", a1["session"])
        with pytest.raises(NotFound):
            await s.close("b", a1["session"])
        assert (await s.close("a", a1["session"]))["closed"] and s.load()["tcp://w0"] == 0
    asyncio.run(go())


def test_records_follow_heartbeats_lost_workers_and_deleted_tenants():
    async def go():
        s, w = sessions(ServiceLimits(), "tcp://w0", "tcp://w1")
        a = await s.open("a", PUSH, 1)
        b = await s.open("b", PUSH, 1)
        t_open = s.sessions[a["session"]].t_open
        s.on_heartbeat({"address": "tcp://w0", "t": t_open - 5, "sessions": []})  # made before it opened
        assert a["session"] in s.sessions
        s.on_heartbeat({"address": "tcp://w0", "t": t_open + 10, "sessions": [{"session": a["session"]}]})
        assert a["session"] in s.sessions
        s.on_heartbeat({"address": "tcp://w0", "t": t_open + 11, "sessions": []})  # closed after idling
        assert a["session"] not in s.sessions
        s.registry.remove("b")  # deleted: its session is closed on its worker at the next report
        s.on_heartbeat({"address": "tcp://w1", "t": t_open + 1, "sessions": [{"session": b["session"]}]})
        await asyncio.gather(*w.spawned)
        assert b["session"] not in s.sessions and w.calls[-1][1]["action"] == "close"
        c = await s.open("a", PUSH, 1)
        s.on_worker_removed(c["address"])
        assert s.sessions == {}
    asyncio.run(go())


def test_a_vector_session_is_split_over_the_least_loaded_workers_and_lives_and_dies_as_one():
    async def go():
        s, w = sessions(ServiceLimits(env_session_workers=2), "tcp://w0", "tcp://w1", "tcp://w2")
        first = await s.open("a", PUSH, 4)  # not a vector session (no autoreset): on one worker
        assert [sh["address"] for sh in first["shards"]] == ["tcp://w0"]
        v = await s.open("a", PUSH, 5, seed=100, autoreset=True)
        assert [(sh["address"], sh["num_envs"]) for sh in v["shards"]] == [("tcp://w1", 3), ("tcp://w2", 2)]
        assert v["num_envs"] == 5 and v["seed"] == 100
        opened = [(a, m["num_envs"], m["seed"], m["session"]) for a, m in w.calls if m["action"] == "open"][1:]
        # env i keeps the first seed seed + i: the second shard's envs start at 3
        assert opened == [("tcp://w1", 3, 100, v["session"]), ("tcp://w2", 2, 103, v["session"])]
        assert s.load() == {"tcp://w0": 4, "tcp://w1": 3, "tcp://w2": 2}
        one = await s.open("b", PUSH, 1, autoreset=True)  # one env: one worker
        assert len(one["shards"]) == 1
        closed = await s.close("a", v["session"])
        assert closed["closed"] and [m["action"] for _, m in w.calls[-2:]] == ["close", "close"]
        # a shard closed after idling (or lost with its worker): the session is gone, its other shard closed
        v2 = await s.open("a", PUSH, 2, autoreset=True)
        (w_a, w_b) = [sh["address"] for sh in v2["shards"]]
        t_open = s.sessions[v2["session"]].t_open
        s.on_heartbeat({"address": w_a, "t": t_open + 10, "sessions": []})
        await asyncio.gather(*w.spawned)
        assert v2["session"] not in s.sessions and w.calls[-1] == (w_b, {"action": "close",
                                                                        "session": v2["session"], "tenant": "a"})
        v3 = await s.open("a", PUSH, 2, autoreset=True)
        s.on_worker_removed(v3["shards"][1]["address"])
        await asyncio.gather(*w.spawned)
        assert v3["session"] not in s.sessions and w.calls[-1][0] == v3["shards"][0]["address"]
        # spread 1: every session on one worker
        s1, _ = sessions(ServiceLimits(env_session_workers=1), "tcp://w0", "tcp://w1")
        assert len((await s1.open("a", PUSH, 4, autoreset=True))["shards"]) == 1
    asyncio.run(go())


def test_a_shard_that_fails_to_open_leaves_no_other_shard_open():
    class OneFails(Workers):
        async def call(self, address, handler, timeout=60.0, **msg):
            if msg["action"] == "open" and address == "tcp://w1":
                self.calls.append((address, msg))
                raise OSError("connection refused")
            return await super().call(address, handler, timeout, **msg)

    async def go():
        w = OneFails("tcp://w0", "tcp://w1")
        s = EnvSessions(w, registry("a"), lambda _t: ServiceLimits())  # type: ignore[arg-type]
        with pytest.raises(Unavailable, match="could not open"):
            await s.open("a", PUSH, 4, autoreset=True)
        await asyncio.gather(*w.spawned)
        assert s.sessions == {} and s._opening["a"] == 0
        assert [(a, m["action"]) for a, m in w.calls] == [("tcp://w0", "open"), ("tcp://w1", "open"),
                                                         ("tcp://w0", "close")]
    asyncio.run(go())


def test_shard_answers_are_joined_in_env_order_with_final_rows_masked_where_no_episode_ended():
    import json

    import numpy as np

    from nexus.gateway.env_shards import join_answers, split_reset, split_step
    from nexus.wire.inputs import decode_array, wire_json

    def answer(state, reward, ended):
        obs = {"state": state, "images": {"cam": np.full((len(state), 2, 2, 3), state[:, :1, None, None], np.uint8)}}
        out = {"reward": reward, "terminated": ended, "obs": obs}
        if ended.any():
            out["final"] = {"mask": ended, "state": state - 1, "images": obs["images"]}
        return wire_json(out)

    s1, s2 = np.arange(6, dtype=np.float32).reshape(3, 2), np.arange(6, 10, dtype=np.float32).reshape(2, 2)
    joined = json.loads(join_answers([answer(s1, np.ones(3, np.float32), np.zeros(3, bool)),
                                      answer(s2, np.full(2, 2, np.float32), np.array([False, True]))]))
    np.testing.assert_array_equal(decode_array(joined["obs"]["state"]), np.arange(10).reshape(5, 2))
    np.testing.assert_array_equal(decode_array(joined["reward"]), [1, 1, 1, 2, 2])
    np.testing.assert_array_equal(decode_array(joined["final"]["mask"]), [0, 0, 0, 0, 1])
    np.testing.assert_array_equal(decode_array(joined["final"]["state"])[4], s2[1] - 1)
    cams = decode_array(joined["obs"]["images"]["cam"])  # the nested images joined like the state, env by env
    assert cams.shape == (5, 2, 2, 3) and cams[:, 0, 0, 0].tolist() == [0, 2, 4, 6, 8]
    assert decode_array(joined["terminated"]).dtype == np.uint8
    assert split_reset([3, 2], [0, 1, 2, 3, None], [True, False, True, False, True]) == [
        {"seeds": [0, 1, 2], "mask": [True, False, True]}, {"seeds": [3, None], "mask": [False, True]}]
    parts = split_step([3, 2], np.arange(20, dtype=np.float32).reshape(5, 4))
    assert [p["shape"] for p in parts] == [[3, 4], [2, 4]]
    np.testing.assert_array_equal(np.frombuffer(parts[1]["actions"], np.float32), np.arange(12, 20))


def test_a_session_call_runs_on_the_workers_loop_only_when_short_and_alone():
    from types import SimpleNamespace

    from nexus.config import catalog
    from nexus.sim.env_sessions import EnvSession

    s = EnvSession("s", "a", catalog.env(PUSH), SimpleNamespace(num_envs=2), autoreset=True, idle_s=60, seed=0,
                   inline_s=0.05)
    assert not s.inline  # the first call is measured on the session thread
    s.last_call_s = 0.01
    assert s.inline
    s.pending = 1  # a call of this session is under way: the next one waits behind it on the thread
    assert not s.inline
    s.pending, s.last_call_s = 0, 0.2
    assert not s.inline
    s.inline_s, s.last_call_s = 0.0, 0.001  # the default: always the thread
    assert not s.inline


def test_a_step_with_actions_as_bytes_is_checked_like_an_array():
    from types import SimpleNamespace

    import numpy as np

    from nexus.config import catalog
    from nexus.sim.env_sessions import EnvSession

    s = EnvSession("s", "a", catalog.env(PUSH), SimpleNamespace(num_envs=2), autoreset=True, idle_s=60, seed=0)
    with pytest.raises(SpecError, match="do not fill the shape"):
        s.step(np.zeros(7, np.float32).tobytes(), shape=[2, 4])
    with pytest.raises(SpecError, match=r"shape \(2, 3\)"):
        s.step(np.zeros((2, 3), np.float32).tobytes(), shape=[2, 3])
    with pytest.raises(SpecError, match="NaN"):
        s.step(np.full((2, 4), np.nan, np.float32).tobytes(), shape=[2, 4])


def test_the_kept_alive_connection_reconnects_backs_off_and_maps_errors():
    """A real HTTP server: the connection it closed while idle is replaced (the call still goes once), a 429 is
    sent again, a 4xx arrives as the gateway's error class, the token travels, and a gone server is Unavailable."""
    import json
    import select
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from nexus.client.http import Backoff, HttpTransport
    from nexus.client.keepalive import KeepAlive, post_json
    from nexus.errors import Conflict, Unavailable

    seen: list[tuple[str, str, int]] = []  # (path, token, the client's port: its connection)
    answers = [(200, {"n": 1}), (200, {"n": 2}), (429, {"retry_after_s": 0.01}), (200, {"n": 3}),
               (409, {"error": {"class": "Conflict", "code": "conflict", "message": "reset first"}})]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers.get("Authorization"), self.client_address[1]))
            status, body = answers[len(seen) - 1]
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = len(seen) == 1  # closed after answering, as an idle keep-alive timeout does

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    transport = HttpTransport(f"http://127.0.0.1:{server.server_port}", token="tok",
                              backoff=Backoff(retries=2, max_s=0.05))
    keep = KeepAlive(transport)
    try:
        assert post_json(transport, keep, "/a", None, b"{}") == {"n": 1}
        for _ in range(100):  # the server's close reaches the client
            if select.select([keep.conn.sock], [], [], 0.01)[0]:
                break
        assert post_json(transport, keep, "/b", None, b"{}") == {"n": 2}
        assert post_json(transport, keep, "/c", None, b"{}") == {"n": 3} and transport.refused == 1
        with pytest.raises(Conflict, match="reset first"):
            post_json(transport, keep, "/d", None, b"{}")
        assert [p for p, _, _ in seen] == ["/a", "/b", "/c", "/c", "/d"]  # each call went once (plus the 429's)
        assert {t for _, t, _ in seen} == {"Bearer tok"}
        assert seen[0][2] != seen[1][2] and seen[1][2] == seen[4][2]  # a new connection, then kept
    finally:
        server.shutdown()
        server.server_close()
        keep.close()
    with pytest.raises(Unavailable, match="unreachable"):
        post_json(transport, keep, "/e", None, b"{}")
    transport.close()
