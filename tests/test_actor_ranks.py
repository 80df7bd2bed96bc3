"""A 2-rank actor group (one gloo group over two Dask worker processes) against a 1-rank one, given the same
requests through the real actor tasks: the same weights after SFT (OFT head, GR00T flow expert), PPO on a
stored camera batch through a LoRA adapter, and low-level ops (a batch smaller than the group included);
each rank holding half of every tenant's optimizer state; an error on one rank's shard raised by both.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nexus.algorithms.ppo import PPOConfig
from nexus.config import catalog
from nexus.config.service import ServiceConfig
from nexus.control import tasks
from nexus.data.output_dir import TenantOutputDir
from nexus.data.trajectory_store import columns_to_table, write_ipc
from nexus.errors import SpecError
from nexus.features import Observation
from nexus.spec import LoraConfig, TenantSpec
from nexus.wire.messages import BatchRef, OpWork, RLWork, SFTWork, TenantSetup, UpdateRequest
from tests.rank_group import RankGroup

pytestmark = pytest.mark.cluster

DATASET = "pickcube-scripted"
ENV = "maniskill/pickcube-rgb"
SFT_OFT = TenantSpec(name="sft-oft", dataset=DATASET, hidden_dim=32, lr=3e-3, seed=3)
SFT_GROOT = TenantSpec(name="sft-groot", dataset=DATASET, hidden_dim=32, lr=3e-3, seed=4, action_head="groot",
                       chunk=4)
RL_LORA = TenantSpec(name="rl-lora", env=ENV, hidden_dim=32, lr=1e-3, seed=5, lora=LoraConfig(rank=4))
SPECS = (SFT_OFT, SFT_GROOT, RL_LORA)
SFT_STEPS, RL_UPDATES = 3, 2
PPO = PPOConfig(update_epochs=2, minibatch_size=8)  # 21 rows: minibatches of 8, 8, 5 rows
# relative, over the policy's weights: ||w2 - w1|| / ||w1||. Per tensor it is looser where the true gradient is
# zero or near it and Adam normalizes float32 noise (attention key biases, GR00T's zero-initialized modulations)
TOLERANCE = 1e-5


def schema_of(spec: TenantSpec):
    return catalog.dataset(spec.dataset).schema if spec.dataset else catalog.env(spec.env).schema


def rl_batch(path, schema, seed: int) -> BatchRef:
    """A stored batch of 3 camera episodes of 7 steps, laid out as a rollout stores it (no cached features:
    every rank computes its rows' backbone features through the tenant's adapter)."""
    rng = np.random.default_rng(seed)
    episodes, steps = 3, 7
    n = episodes * steps
    last = np.tile(np.arange(steps) == steps - 1, episodes)
    cols = {"episode": np.repeat(np.arange(episodes), steps).astype(np.int64),
            "step": np.tile(np.arange(steps), episodes).astype(np.int32),
            "state": rng.normal(size=(n, schema.proprio_dim)).astype(np.float32),
            "action": rng.uniform(-1, 1, (n, schema.action_dim)).astype(np.float32),
            "reward": rng.normal(size=n).astype(np.float32), "terminated": last, "truncated": np.zeros(n, bool),
            "success": last, "logprob": rng.normal(-3, 0.5, n).astype(np.float32),
            "value": rng.normal(size=n).astype(np.float32), "policy_version": np.zeros(n, np.int64)}
    for c in schema.cameras:
        cols[f"image.{c.name}"] = rng.integers(0, 256, (n, c.height, c.width, 3), dtype=np.uint8)
    write_ipc(columns_to_table(cols, schema, RL_LORA.name), path)
    return BatchRef(str(path), n, episodes, 0, RL_LORA.name)


def op_batch(schema, rows: int, seed: int, bad_row: int | None = None) -> dict:
    """A client's batch; with ``bad_row`` a PPO batch whose row ``bad_row`` has an impossible old log-probability
    (within the accepted magnitudes) and the lowest advantage: its importance ratio, hence its loss, is inf."""
    rng = np.random.default_rng(seed)
    obs = [Observation(state=rng.normal(size=schema.proprio_dim).astype(np.float32),
                       images={c.name: rng.integers(0, 256, (c.height, c.width, 3), dtype=np.uint8)
                               for c in schema.cameras}) for _ in range(rows)]
    actions = rng.uniform(-1, 1, (rows, schema.action_dim)).astype(np.float32)
    if bad_row is None:
        return {"observations": obs, "actions": actions}
    logprobs, advantages = np.full(rows, -3.0, np.float32), np.ones(rows, np.float32)
    logprobs[bad_row], advantages[bad_row] = -1e6, -1.0
    return {"observations": obs, "actions": actions, "logprobs": logprobs, "advantages": advantages,
            "returns": np.zeros(rows, np.float32)}


def drive(group: RankGroup, root, batches: dict[int, BatchRef]) -> dict:
    """The same requests on any group -> what the test compares."""
    n = group.ranks
    setups = {s.name: TenantSetup(s.name, s, schema_of(s), str(root / "tenants" / s.name)) for s in SPECS}

    def update(item: str, tenant: str, work, data=None):
        return group.run(tasks.RUN_UPDATE, lambda r: (UpdateRequest(item, None, work, setups[tenant], (), rank=r,
                                                                    world_size=n),), data)

    for setup in setups.values():
        group.run(tasks.INIT_TENANT, lambda r, s=setup: (s,))
    metrics: dict[str, list] = {s.name: [] for s in SPECS}
    for step in range(SFT_STEPS):
        for spec in (SFT_OFT, SFT_GROOT):
            res = update(f"{spec.name}-{step}", spec.name, SFTWork(DATASET, step, 15, eval_heldout=step == 2))
            metrics[spec.name].append(res.metrics)
    for k in range(RL_UPDATES):
        metrics[RL_LORA.name].append(update(f"rl-{k}", RL_LORA.name, RLWork(batches[k], PPO)).metrics)
    # low-level ops on the OFT tenant: 3 rows, a refused batch (its bad row on rank 1's shard), 1 row
    schema = schema_of(SFT_OFT)
    fb = OpWork("forward_backward", "sft")
    metrics["ops"] = [update("op-0", SFT_OFT.name, fb, op_batch(schema, 3, 0)).metrics]
    with pytest.raises(SpecError, match="ppo loss is inf"):
        update("op-1", SFT_OFT.name, OpWork("forward_backward", "ppo"), op_batch(schema, 4, 1, bad_row=1))
    metrics["ops"].append(update("op-2", SFT_OFT.name, fb, op_batch(schema, 1, 2)).metrics)
    pending = [st[SFT_OFT.name]["pending_backward"] for st in group.slot_states()]
    update("op-3", SFT_OFT.name, OpWork("optim_step"))
    saved = update("op-4", SFT_OFT.name, OpWork("save_weights")).version
    weights = {}
    for s in SPECS:
        out = TenantOutputDir(setups[s.name].output_dir)
        weights[s.name] = {v: torch.load(out.weights_path(v), weights_only=True) for v in (0, out.highest_version())}
    return {"metrics": metrics, "weights": weights, "states": group.slot_states(), "pending": pending,
            "saved": saved}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = tmp_path_factory.mktemp("batches")
    batches = {k: rl_batch(data / f"rl-{k}.arrow", schema_of(RL_LORA), 10 + k) for k in range(RL_UPDATES)}
    out = {}
    for n in (1, 2):
        root = tmp_path_factory.mktemp(f"ranks{n}")
        with RankGroup(ServiceConfig(root=str(root)), n) as group:
            out[n] = drive(group, root, batches)
    return out


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over every tensor of two state dicts."""
    assert a.keys() == b.keys()
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    return (diff / sum(float(a[k].double().pow(2).sum()) for k in a)) ** 0.5


@pytest.mark.parametrize("tenant", [s.name for s in SPECS])
def test_two_ranks_train_the_same_weights_as_one(runs, tenant):
    one, two = runs[1]["weights"][tenant], runs[2]["weights"][tenant]
    assert one.keys() == two.keys() and len(one) == 2, "both groups published the same versions"
    last = max(one)
    assert relative_error(one[0], one[last]) > 1e-3, "the updates moved the weights"
    err = relative_error(one[last], two[last])
    print(f"{tenant}: 2-rank vs 1-rank relative weight error {err:.2e}")
    assert err <= TOLERANCE
    for m1, m2 in zip(runs[1]["metrics"][tenant], runs[2]["metrics"][tenant], strict=True):
        for k in ("loss", "heldout_action_mse", "pg_loss", "v_loss", "approx_kl", "grad_norm"):
            if k in m1:  # the batch's stats, combined from both shards
                assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k


def test_low_level_ops_split_the_client_batch(runs):
    assert runs[1]["saved"] == runs[2]["saved"]
    assert runs[1]["pending"] == [2] and runs[2]["pending"] == [2, 2], "the refused batch accumulated nothing"
    for m1, m2 in zip(runs[1]["metrics"]["ops"], runs[2]["metrics"]["ops"], strict=True):
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)


def test_each_rank_holds_half_of_every_optimizer_state(runs):
    (one,), ranks = runs[1]["states"], runs[2]["states"]
    for s in SPECS:
        whole = one[s.name]["optimizer_bytes"]
        parts = [st[s.name]["optimizer_bytes"] for st in ranks]
        assert [st[s.name]["rank"] for st in ranks] == [0, 1] and ranks[0][s.name]["world_size"] == 2
        for p in parts:
            assert p / whole == pytest.approx(0.5, abs=0.02), (s.name, parts, whole)
        assert sum(parts) == pytest.approx(whole, rel=0.01)  # partitioned, not replicated
