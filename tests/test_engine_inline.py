"""An inference engine runs a short group on its event loop (``qos.engine_inline_forward_ms``) only when its size's
last forward was short, nothing else waits and the model thread is idle; the answers are the model thread's."""

from __future__ import annotations

import asyncio
import io
import time

import numpy as np
import torch

from nexus.config import ServiceConfig
from nexus.features import Observation, TenantSchema
from nexus.model.framework import VLAFramework
from nexus.model.policy import TenantPolicy
from nexus.services.inference import InferenceEngine
from nexus.spec import TenantSpec

SCHEMA = TenantSchema(proprio_dim=9, action_dim=4, instruction="push the cube to the goal")
SPEC = TenantSpec(name="a", env="maniskill/pushcube-state", seed=1, hidden_dim=32)


def engine_with_tenant(tiny_backbone, tmp_path, inline_ms: float) -> InferenceEngine:
    # groups of one row: requests sent together wait behind each other's groups
    engine = InferenceEngine(ServiceConfig(root=str(tmp_path), infer_max_batch=1,
                                           qos={"engine_inline_forward_ms": inline_ms}))
    engine.heads.framework = VLAFramework(tiny_backbone)
    policy = TenantPolicy.from_spec(SPEC, SCHEMA, tiny_backbone.hidden_size)
    buf = io.BytesIO()
    torch.save(policy.state_dict(), buf)
    engine.heads.register(SPEC, SCHEMA, 0, buf.getvalue())
    return engine


def obs(seed: int) -> Observation:
    return Observation(state=np.random.default_rng(seed).normal(size=9).astype(np.float32))


async def predict(engine: InferenceEngine, seed: int) -> np.ndarray:
    out = await engine.predict_rows([("a", obs(seed), None, True, None, 1)])
    return out["outputs"][0]["action"]


def test_short_groups_run_inline_only_when_the_model_thread_is_idle(tiny_backbone, tmp_path):
    engine = engine_with_tenant(tiny_backbone, tmp_path, inline_ms=20.0)  # the tiny head: well under 20 ms

    async def scenario() -> None:
        first = await predict(engine, 0)
        assert engine.inline_groups == 0  # a size never timed goes to the model thread
        again = await predict(engine, 0)
        assert engine.inline_groups == 1  # its last forward was short: on the loop
        np.testing.assert_allclose(again, first, rtol=1e-6, atol=1e-6)  # the same answer either way

        # the model thread busy (as with a weight load): the group waits for it there, never beside it
        busy = asyncio.ensure_future(engine._in_model_thread(time.sleep, 0.3))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        during = await predict(engine, 0)
        assert engine.inline_groups == 1 and time.perf_counter() - t0 > 0.15
        await busy
        np.testing.assert_allclose(during, first, rtol=1e-6, atol=1e-6)

        # requests waiting behind a group: the model thread takes it (the loop reads the next ones meanwhile);
        # only the last, with nothing behind it, runs on the loop
        inline = engine.inline_groups
        answers = await asyncio.gather(*(predict(engine, s) for s in range(4)))
        assert engine.inline_groups == inline + 1
        np.testing.assert_allclose(answers[0], first, rtol=1e-6, atol=1e-6)

    asyncio.run(scenario())
    engine.close()


def test_zero_keeps_every_group_in_the_model_thread(tiny_backbone, tmp_path):
    engine = engine_with_tenant(tiny_backbone, tmp_path, inline_ms=0.0)

    async def scenario() -> None:
        for s in range(3):
            await predict(engine, s)

    asyncio.run(scenario())
    assert engine.inline_groups == 0
    engine.close()
