"""The openpi endpoint's parts without a service: the msgpack-numpy codec against openpi-client's own, the
observation map, and the inference queue's deadline rule (a forming group never holds a request past its
deadline minus the expected forward)."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy

from nexus.engine.batching import GroupBatcher
from nexus.engine.queue import Group, InferenceQueue
from nexus.errors import SpecError
from nexus.features import CameraSpec, TenantSchema
from nexus.gateway.msgpack_arrays import MalformedFrame, pack, unpack
from nexus.gateway.openpi import api_key, check_keys, default_keys, to_observation

SCHEMA = TenantSchema(proprio_dim=3, action_dim=2, cameras=(CameraSpec("front", 4, 5), CameraSpec("wrist", 4, 5),
                                                          CameraSpec("side", 4, 5)), instruction="do it")


def test_codec_speaks_openpi_clients_encoding_both_ways():
    obs = {"observation/image": np.arange(60, dtype=np.uint8).reshape(4, 5, 3),
           "observation/state": np.array([0.5, -1.0, 2.0], np.float32), "prompt": "go", "n": np.int64(3),
           "nested": {"a": [np.zeros((2, 0), np.float64), True]}}
    got = unpack(msgpack_numpy.packb(obs))  # what the robot sends, as we read it
    assert got["prompt"] == "go" and got["n"] == 3 and got["n"].dtype == np.int64
    for k in ("observation/image", "observation/state"):
        assert got[k].dtype == obs[k].dtype and np.array_equal(got[k], obs[k])
    assert got["nested"]["a"][0].shape == (2, 0) and got["nested"]["a"][1] is True
    reply = {"actions": np.linspace(0, 1, 8, dtype=np.float32).reshape(4, 2), "version": 3,
             "server_timing": {"total_ms": 1.5}}
    back = msgpack_numpy.unpackb(pack(reply))  # what the robot reads of our reply
    assert back["version"] == 3 and back["server_timing"] == {"total_ms": 1.5}
    assert back["actions"].dtype == np.float32 and np.array_equal(back["actions"], reply["actions"])
    assert np.array_equal(msgpack_numpy.unpackb(pack(np.float32(2.5))), np.float32(2.5))


@pytest.mark.parametrize("frame,phrase", [
    (b"\xc1", "not a msgpack frame"),
    (b"\x93\x01", "not a msgpack frame"),  # a list of 3 with one item
    (msgpack.packb({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "|O", b"shape": [1]}), "plain numeric"),
    (msgpack.packb({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "<c8", b"shape": [1]}), "plain numeric"),
    (msgpack.packb({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "V8", b"shape": [1]}), "plain numeric"),
    (msgpack.packb({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "nonsense", b"shape": [1]}), "not a numpy"),
    (msgpack.packb({b"__ndarray__": True, b"data": b"\0" * 4, b"dtype": "<f4", b"shape": [2]}), "does not fill"),
    (msgpack.packb({b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [-1]}), "non-negative"),
    (msgpack.packb({b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [2**20, 2**20]}), "more than"),
    (msgpack.packb({b"__ndarray__": True, b"data": b"", b"dtype": "<f4"}), "exactly the keys"),
    (msgpack.packb({b"__npgeneric__": True, b"data": "x", b"dtype": "<f4"}), "not a number"),
    (msgpack.packb({b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}), "does not fit"),
    (msgpack.packb({1: 2}), "not a msgpack frame"),  # map keys are strings
    (b"\x91" * 100_000 + b"\x01", "not a msgpack frame"),  # nesting deeper than msgpack's stack
])
def test_codec_refuses_what_is_not_a_numeric_array(frame, phrase):
    with pytest.raises(MalformedFrame, match=phrase):
        unpack(frame)


def test_observation_map_default_custom_and_refusals():
    keys = default_keys(SCHEMA)
    assert keys == {"observation/state": "state", "prompt": "instruction", "observation/image": "images.front",
                    "observation/wrist_image": "images.wrist", "observation/side": "images.side"}
    img = np.zeros((4, 5, 3), np.uint8)
    obs = to_observation({"observation/state": [1, 2, 3], "observation/image": img, "observation/wrist_image": img,
                          "observation/side": img.transpose(2, 0, 1)}, keys, SCHEMA, 100)
    assert obs.state.dtype == np.float32 and set(obs.images) == {"front", "wrist", "side"} and obs.instruction == ""
    with pytest.raises(SpecError, match=r"observation/state: expected 3 numbers"):
        to_observation({"observation/state": [1, 2], "observation/image": img, "observation/wrist_image": img,
                        "observation/side": img}, keys, SCHEMA, 100)
    with pytest.raises(SpecError, match=r"observation/side: expected shape \(4, 5, 3\)"):
        to_observation({"observation/state": [1, 2, 3], "observation/image": img, "observation/wrist_image": img,
                        "observation/side": img[:3]}, keys, SCHEMA, 100)
    with pytest.raises(SpecError, match="missing key"):
        to_observation({"observation/state": [1, 2, 3]}, keys, SCHEMA, 100)
    custom = check_keys({"s": "state", "a": "images.front", "b": "images.wrist", "c": "images.side"}, SCHEMA)
    assert to_observation({"s": [0, 0, 0], "a": img, "b": img, "c": img}, custom, SCHEMA, 10).instruction == ""
    for bad, phrase in [({"s": "state"}, "mapped 0 times"), ({"s": "state", "t": "state", "a": "images.front",
                        "b": "images.wrist", "c": "images.side"}, "mapped 2 times"),
                        ({"s": "nope"}, "the tenant's fields"), ({"batch": "state"}, "not an observation key"),
                        ([], "expected an object")]:
        with pytest.raises(SpecError, match=phrase):
            check_keys(bad, SCHEMA)
    assert api_key("Api-Key abc") == "abc" and api_key("Bearer abc") == "abc"
    assert api_key("Basic abc") is None and api_key(None) is None and api_key("Api-Key ") is None


def test_batcher_fires_by_the_earliest_deadline_minus_the_expected_forward():
    b = GroupBatcher(max_wait_s=1.0, max_batch=8)
    b.observe_forward(0.03)
    assert b.forward_s == pytest.approx(0.03)
    b.add("plain", now=0.0)
    assert b.due_in(now=0.0) == pytest.approx(1.0)  # no deadline: T
    b.add("robot", now=0.01, deadline=0.11)
    assert b.due_in(now=0.01) == pytest.approx(0.07)  # 0.11 - 0.03 expected forward - now
    assert b.reason(now=0.079) is None and b.reason(now=0.08) == "deadline"
    b.add("later", now=0.02, deadline=0.5)
    b.add("urgent", now=0.03, deadline=0.09)
    assert b.due_in(now=0.03) == pytest.approx(0.03)
    # B = 2 of 4 pending: the requests out of time go first, then the others oldest first
    b.set_limits(1.0, 2)
    assert b.take(now=0.08) == ["robot", "urgent"]
    assert b.latest_start() == pytest.approx(0.47) and b.take(now=0.5) == ["plain", "later"]
    b.observe_forward(0.13)  # a running mean
    assert 0.03 < b.forward_s < 0.13


def test_inference_queue_never_holds_a_request_past_its_deadline():
    async def main() -> list[str]:
        groups: list[Group] = []

        async def forward(rows):
            return [r * 10 for r in rows]

        q = InferenceQueue(GroupBatcher(max_wait_s=60.0, max_batch=8), forward, groups.append)
        loop = asyncio.get_running_loop()
        waiting = loop.create_task(q.submit([1], None))  # alone it would wait T = 60 s
        await asyncio.sleep(0)
        out = await asyncio.wait_for(q.submit([2], None, deadline=loop.time() + 0.05), 30)
        assert out[0] == [20]
        assert (await asyncio.wait_for(waiting, 30))[0] == [10]  # it joined the deadline's group
        return [g.reason for g in groups]

    assert asyncio.run(main()) == ["deadline"]


def test_predict_group_goes_out_in_one_call_rerouted_together_all_or_none_admitted():
    from nexus.config.service import QosSettings
    from nexus.errors import Overloaded
    from nexus.gateway.serving import PredictServer
    from tests.test_qos_units import Engines

    routes = Engines()  # e0 refuses as draining: every request of the group is sent again to e1
    server = PredictServer(routes, QosSettings(max_gateway_predicts=16, engine_calls_in_flight=1), lambda t: 4)
    sent: list[list] = []
    predict_many = routes.predict_many

    async def recording(ep, requests):
        sent.append(requests)
        return await predict_many(ep, requests)

    routes.predict_many = recording

    async def main() -> None:
        spans: dict[str, float] = {}
        deadline = asyncio.get_running_loop().time() + 5.0
        outs = await server.predict_group("a", [1, 2, 3], None, True, spans, deadline)
        assert outs == [{"tenant": "a"}] * 3 and routes.calls == [("e0", ["a"] * 3), ("e1", ["a"] * 3)]
        assert all(len(r) == 8 and 0 < r[7] <= 5.0 for r in sent[-1])  # the time left to the deadline travels
        assert [r[1] for r in sent[-1]] == [1, 2, 3] and {"gateway_queue", "forward"} <= set(spans)
        with pytest.raises(Overloaded, match="max_inflight_predicts=4"):
            await server.predict_group("a", [1] * 5, None, True, {})
        assert server.budgets.held_total == 0  # none kept of a refused group
        await server.predict("a", 9, None, True, {})
        assert len(sent[-1][0]) == 7  # no deadline: the wire as before
        await server.predict("a", 9, None, True, {}, deadline=asyncio.get_running_loop().time() + 2.0)
        assert len(sent[-1][0]) == 8 and 0 < sent[-1][0][7] <= 2.0

    asyncio.run(main())
