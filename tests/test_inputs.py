"""nexus.wire.inputs: every malformed observation or batch is a SpecError naming field, expected and actual;
good data comes back normalized (float32 state and actions, uint8 images). No torch, no cluster."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from nexus.errors import SpecError
from nexus.features import CameraSpec, Observation, TenantSchema
from nexus.wire.inputs import check_batch, check_observation, decode_array, encode_array

STATE = TenantSchema(proprio_dim=3, action_dim=2)
RGB = TenantSchema(proprio_dim=2, action_dim=2, cameras=(CameraSpec("front", 4, 5),))


def _obs(**kw):
    return {"state": [0.1, 0.2, 0.3], **kw}


def test_importable_without_torch():
    code = "import sys, nexus.wire.inputs; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_good_observation_normalized():
    o = check_observation(_obs(instruction="push"), STATE)
    assert o.state.dtype == np.float32 and o.state.shape == (3,) and o.instruction == "push"
    img = np.random.randint(0, 256, (4, 5, 3), dtype=np.uint8)
    o = check_observation({"state": encode_array(np.ones(2)), "images": {"front": img.tolist()}}, RGB)
    assert o.images["front"].dtype == np.uint8 and (o.images["front"] == img).all()
    same = check_observation(Observation(state=np.ones(2, np.float32), images={"front": img}), RGB)
    assert (same.images["front"] == img).all()


def test_wire_roundtrip_exact():
    a = np.random.randn(3, 4).astype(np.float32)
    assert (decode_array(encode_array(a)) == a).all()
    assert decode_array(encode_array(a)).dtype == np.float32


@pytest.mark.parametrize("obs, schema, phrase", [
    (None, STATE, "got null"),
    ([1, 2, 3], STATE, "expected an observation"),
    ({}, STATE, "observation.state: missing"),
    ({"state": None}, STATE, "observation.state: got null"),
    (_obs(state="abc"), STATE, "observation.state: got a string"),
    (_obs(state=[1, 2]), STATE, "expected 3 numbers"),
    (_obs(state=[[1, 2, 3]]), STATE, "got shape (1, 3)"),
    (_obs(state=[1, "a", 3]), STATE, "non-numbers"),
    (_obs(state=[1, [2], 3]), STATE, "ragged"),
    (_obs(state=[float("nan"), 0, 0]), STATE, "NaN or infinite"),
    (_obs(state=[float("inf"), 0, 0]), STATE, "NaN or infinite"),
    (_obs(state=[1e30, 0, 0]), STATE, "magnitudes"),
    (_obs(state=[True, False, True]), STATE, "booleans"),
    (_obs(state=[10**30, 0, 0]), STATE, "integers too large"),
    (_obs(extra=1), STATE, "unknown field(s) ['extra']"),
    (_obs(instruction=5), STATE, "instruction: expected a string"),
    (_obs(instruction="x" * 3000), STATE, "max_instruction_chars"),
    (_obs(images={"cam": [[0]]}), STATE, "unknown camera(s) ['cam']"),
    (_obs(images=[1]), STATE, "expected an object camera -> image"),
    ({"state": [0, 0]}, RGB, "images.front: missing"),
    ({"state": [0, 0], "images": {"front": np.zeros((5, 4, 3), np.uint8)}}, RGB, "expected shape (4, 5, 3)"),
    ({"state": [0, 0], "images": {"front": np.full((4, 5, 3), 300)}}, RGB, "uint8 values 0..255"),
    ({"state": [0, 0], "images": {"front": np.full((4, 5, 3), 0.5)}}, RGB, "uint8 values 0..255"),
    ({"state": {"dtype": "float32", "shape": [3], "b64": "AAAA"}}, STATE, "do not fit shape"),
    ({"state": {"dtype": "complex", "shape": [3], "b64": ""}}, STATE, "dtype 'complex'"),
    ({"state": {"dtype": "float32", "shape": [-1], "b64": ""}}, STATE, "non-negative integers"),
    ({"state": {"dtype": "float32", "shape": [3], "b64": "!!"}}, STATE, "not valid base64"),
    ({"state": {"dtype": "float32"}}, STATE, "exactly the keys"),
])
def test_bad_observations(obs, schema, phrase):
    with pytest.raises(SpecError) as e:
        check_observation(obs, schema)
    assert phrase in str(e.value)


def _batch(n=2, **kw):
    return {"observations": [_obs() for _ in range(n)], "actions": np.zeros((n, 2)).tolist(), **kw}


def test_good_batches():
    out = check_batch(_batch(), STATE, "sft")
    assert out["actions"].dtype == np.float32 and out["actions"].shape == (2, 2)
    assert all(isinstance(o, Observation) for o in out["observations"])
    ppo = check_batch(_batch(logprobs=[0, 0], advantages=[1, -1], returns=[0, 1], ppo={"clip_coef": 0.1}),
                      STATE, "ppo")
    assert ppo["ppo"]["clip_coef"] == 0.1 and ppo["returns"].shape == (2,)
    chunked = check_batch({"observations": [_obs()], "actions": np.zeros((1, 3, 2)).tolist()}, STATE, "sft", chunk=3)
    assert chunked["actions"].shape == (1, 6)


@pytest.mark.parametrize("batch, loss, kw, phrase", [
    ([], "sft", {}, "batch: expected an object"),
    ({"observations": [], "actions": []}, "sft", {}, "the batch is empty"),
    ({"observations": "x", "actions": []}, "sft", {}, "expected a list of observations"),
    ({"actions": [[0, 0]]}, "sft", {}, "expected a list of observations"),
    ({"observations": [_obs()]}, "sft", {}, "batch.actions: missing"),
    (_batch(actions=[[0, 0, 0], [0, 0, 0]]), "sft", {}, "batch.actions: expected shape (2, 2)"),
    (_batch(actions=[["a", "b"], ["c", "d"]]), "sft", {}, "batch.actions: got non-numbers"),
    (_batch(actions=[[float("nan"), 0], [0, 0]]), "sft", {}, "NaN or infinite"),
    (_batch(actions=[[0, 0]]), "sft", {}, "expected shape (2, 2)"),
    (_batch(foo=1), "sft", {}, "unknown field(s) ['foo']"),
    (_batch(), "bogus", {}, "unknown loss 'bogus'"),
    (_batch(), "ppo", {}, "batch.logprobs: missing"),
    (_batch(logprobs=[0, 0], advantages=[0], returns=[0, 0]), "ppo", {}, "batch.advantages: expected 2 numbers"),
    (_batch(logprobs=[0, 0], advantages=[0, 0], returns=[0, 0], ppo={"gamma": 2}), "ppo", {}, "batch.ppo: gamma"),
    (_batch(logprobs=[0, 0], advantages=[0, 0], grpo={"beta": 1}), "grpo", {}, "unknown field(s) ['beta']"),
    (_batch(), "ppo", {"chunk": 4}, "chunk=4"),
    (_batch(n=5), "sft", {"max_rows": 4}, "max_batch_rows=4"),
    ({"observations": [_obs(state=[1])], "actions": [[0, 0]]}, "sft", {}, "batch.observations[0].state"),
])
def test_bad_batches(batch, loss, kw, phrase):
    with pytest.raises(SpecError) as e:
        check_batch(batch, STATE, loss, **kw)
    assert phrase in str(e.value)
