"""The paper-scale bench's workload files (experiments/paper_scale/workloads/*.toml) parse into typed settings,
and a bad file is refused with an error naming its key (experiments/paper_scale/workload.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nexus.errors import SpecError

HERE = Path(__file__).resolve().parents[1] / "experiments" / "paper_scale"
sys.path.insert(0, str(HERE))

import workload  # noqa: E402

FILES = sorted((HERE / "workloads").glob("*.toml"))


def test_the_shipped_workloads_parse() -> None:
    assert {f.stem for f in FILES} >= {"paper_exp1", "bursty", "large64"}
    for f in FILES:
        wf = workload.load(f)
        jobs = wf.draw(wf.tuning.score_seeds[0])
        assert jobs and all(j["spec"]["seed"] == wf.tuning.score_seeds[0] for j in jobs)
        assert wf.tuning.calibration_seed not in wf.tuning.score_seeds


def test_paper_exp1_is_the_papers_workload() -> None:
    wf = workload.load("paper_exp1")
    envs = [t.spec.get("env") for t in wf.tenants if t.jobs[0].job["kind"] == "rl"]
    assert envs[0] == "libero/spatial" and sum(e.startswith("maniskill/") for e in envs) == 2
    sft = [j for j in wf.draw(1) if j["job"]["kind"] == "sft"]
    assert len(sft) > 1 and len({j["arrival_s"] for j in sft}) == len(sft)  # submitted continuously
    assert (wf.shared.devices, wf.isolated.devices) == ("2-2-4", "1-1-2")


def test_poisson_arrivals_follow_the_seed() -> None:
    wf = workload.load("bursty")
    a, b, c = ([j["arrival_s"] for j in wf.draw(s)] for s in (1, 1, 2))
    assert a == b and a != c
    assert any(j["job"]["kind"] == "eval" for j in wf.draw(1))


@pytest.mark.parametrize(("edit", "named"), [
    (lambda t: t.replace("every_s = 12.5", "every_sec = 12.5"), "every_sec"),
    (lambda t: t.replace("updates = 3,", "updatez = 3,"), "updatez"),
    (lambda t: t.replace('devices = "2-2-4"', 'devices = "2-2"'), "2-2"),
    (lambda t: t.replace("calibration_seed = 100", "calibration_seed = 1"), "calibration_seed"),
    (lambda t: t.replace("producers_per_sim = 1\n", "producers_per_sim = 0\n", 1), "producers_per_sim"),
    (lambda t: t.replace('action_dim = 7, hidden_dim', 'action_dims = 7, hidden_dim'), "action_dims"),
])
def test_a_bad_workload_is_refused_naming_its_key(tmp_path: Path, edit, named: str) -> None:
    bad = edit((HERE / "workloads" / "paper_exp1.toml").read_text())
    path = tmp_path / "bad.toml"
    path.write_text(bad)
    with pytest.raises(SpecError, match=named):
        workload.load(path)
