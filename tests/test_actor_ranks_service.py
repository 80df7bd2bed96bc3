"""The embedded service with ``actor_ranks = 2``: two ACTOR workers form one group (its sockets on the
service's host only), both tenants' slots live on both ranks with their optimizer state split between them,
and a SIGKILL of rank 1 in the middle of an update is survived: the whole group is rebuilt on fresh processes
from the checkpoints, the interrupted item is re-run, an SFT and an RL tenant finish their jobs, and no
published version is lost, rewritten or used twice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nexus.client.api import Nexus
from nexus.client.faults import kill_worker_while, wait_for
from nexus.spec import TenantSpec
from nexus.worker.plugin import slot_states

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def nx(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    with Nexus.local(root, n_sim=1, n_infer=1, inference_engines=1, actor_ranks=2) as nexus:
        nexus.create_tenant(TenantSpec(name="sft", dataset="pickcube-scripted", env="maniskill/pickcube-state",
                                       action_dim=4, lr=1e-3, seed=41))
        nexus.create_tenant(TenantSpec(name="rl", env="maniskill/pushcube-state", seed=42))
        yield nexus


def _published(nx: Nexus, tenant: str) -> dict[int, str]:
    """version -> sha256 of its weights file (checked against the manifest's record)."""
    t = {x["tenant"]: x for x in nx.status()["tenants"]}[tenant]
    m = json.loads((Path(t["output_dir"]) / "manifest.json").read_text())
    versions = [v["version"] for v in m["versions"]]
    assert versions == sorted(set(versions)), f"versions re-used or out of order: {versions}"
    out = {}
    for v in m["versions"]:
        digest = hashlib.sha256(Path(v["weights"]).read_bytes()).hexdigest()
        assert digest == v["sha256"], f"weights of {tenant} v{v['version']} changed"
        out[v["version"]] = digest
    return out


def _restores(nx: Nexus, tenant: str) -> list[dict]:
    t = {x["tenant"]: x for x in nx.status()["tenants"]}[tenant]
    return json.loads((Path(t["output_dir"]) / "manifest.json").read_text()).get("restores", [])


def _actor_slots(nx: Nexus) -> dict[str, dict]:
    names = {w["address"]: w["name"] for w in nx.status()["workers"]}
    return {names[a]: s for a, s in nx.service.client.run(slot_states).items() if names.get(a, "").startswith("actor-")}


def test_two_ranks_form_one_group_bound_to_the_service_host(nx):
    st = nx.status()["actor"]
    assert st["ranks"] == 2 and st["ready"] and sorted(st["workers"]) == ["actor-0", "actor-1"]
    slots = _actor_slots(nx)
    for name in ("sft", "rl"):
        per_rank = [slots[f"actor-{r}"][name] for r in (0, 1)]
        assert [s["rank"] for s in per_rank] == [0, 1] and {s["world_size"] for s in per_rank} == {2}
        assert per_rank[0]["optimizer_bytes"] == pytest.approx(per_rank[1]["optimizer_bytes"], rel=0.02)
    listening = nx.service.listening()
    assert listening and {ip for _, _, ip, _ in listening} == {"127.0.0.1"}, listening


def test_sigkill_of_rank_1_mid_update_is_survived(nx):
    before = {t: _published(nx, t) for t in ("sft", "rl")}
    lost_before = nx.status()["service"]["retried_items"]["role_lost"]
    # the SFT job keeps the actor group busy (its batches are ready at once) while the RL job collects
    jobs = {"rl": nx.tenant("rl").rl(updates=3, episodes_per_batch=1, collectors=1,
                                     ppo={"update_epochs": 8, "minibatch_size": 8}),
            "sft": nx.tenant("sft").sft(steps=40, batch_size=32)}
    wait_for(lambda: jobs["sft"].info()["progress"].get("steps", 0) >= 3, 600, what="the SFT job training")
    mid = {t: _published(nx, t) for t in ("sft", "rl")}
    # frozen while an update runs, so the kill cannot land between two updates
    kill_worker_while(nx, "actor-1", lambda: nx.status()["actor"]["running"])
    results = {t: j.result(timeout=600) for t, j in jobs.items()}
    assert results["sft"]["steps"] == 40 and results["rl"]["updates"] == 3
    for t in ("sft", "rl"):
        after = _published(nx, t)
        for v, digest in {**before[t], **mid[t]}.items():
            assert after[v] == digest, f"{t} v{v} rewritten"
        assert max(after) == results[t]["version"] > max(mid[t]), "training went on after the kill"
        assert all(r["lost_updates"] == 0 for r in _restores(nx, t)), "checkpoint_every=1: nothing lost"
    wait_for(lambda: all(r["state"] == "healthy" for r in nx.status()["roles"]
                         if not r["role"].startswith("producer/")), 300, what="all roles healthy")
    roles = {r["role"]: r for r in nx.status()["roles"]}
    # the survivor's process group was broken: both ranks run on fresh processes
    assert roles["actor/1"]["restarts"] >= 1 and roles["actor/0"]["restarts"] >= 1
    st = nx.status()
    assert st["service"]["retried_items"]["role_lost"] >= lost_before + 1, "the interrupted update was re-run"
    assert st["actor"]["epoch"] >= 2 and all(x["inflight"] == 0 for x in st["tenants"])
    slots = _actor_slots(nx)
    for t in ("sft", "rl"):
        assert slots["actor-0"][t]["version"] == slots["actor-1"][t]["version"] == results[t]["version"]
