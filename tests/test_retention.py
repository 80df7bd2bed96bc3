"""Retention (``TenantOutputDir.prune``, the one mechanism behind ``limits.max_versions_kept`` and
``limits.max_checkpoints_kept``): version weights — the newest N, plus the initial and every evaluated one — and
the newest M DeepSpeed checkpoints."""

from __future__ import annotations

import json

import pytest

from nexus.config.service import ServiceConfig
from nexus.data.output_dir import TenantOutputDir, mark_evaluation, unmark_evaluation
from nexus.errors import NotFound


def _publish(out: TenantOutputDir, versions: range, keep_last: int, checkpoints: int = 3) -> None:
    for v in versions:  # what the actor does per version: write the head once, record it, prune
        out.write_weights(v, b"w" * 16 + bytes([v]))
        out.add_version(v, "test", keep=(keep_last, checkpoints))


def _on_disk(out: TenantOutputDir) -> set[int]:
    return {int(p.stem[1:]) for p in (out.path / "weights").glob("v*.pt")}


def test_keeps_last_n_evaluated_and_initial(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    _publish(out, range(0, 10), keep_last=3)
    assert _on_disk(out) == {0, 7, 8, 9}
    mark_evaluation(str(out.path), "t-eval-1", 8)  # an evaluation starts on version 8
    _publish(out, range(10, 20), keep_last=3)
    assert _on_disk(out) == {0, 8, 17, 18, 19}
    m = out.read()
    pruned = set(out.pruned_versions(m))
    assert pruned == set(range(20)) - {0, 8, 17, 18, 19}  # the manifest says what is gone
    assert m["pruned_versions"] == [[1, 7], [9, 16]]
    assert [e["version"] for e in m["versions"]] == [0, 8, 17, 18, 19]  # it lists the kept ones
    history = out.version_history()
    assert [e["version"] for e in history] == list(range(20))  # the history of versions stays complete
    assert {e["version"] for e in history if e.get("pruned")} == pruned
    assert all(len(e["sha256"]) == 64 for e in history)  # with the digest of the weights written once
    out.add_version(3, "again")  # listing a pruned version again changes nothing
    assert out.read() == m


def test_the_manifest_stays_bounded_however_many_versions_are_published(tmp_path):
    """It is rewritten at every version: its size follows retention, not the versions ever published
    (a long SFT job publishes one per step)."""
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    sizes = {}
    for v in range(400):
        out.write_weights(v, b"w" * 16 + v.to_bytes(2, "big"))
        (out.checkpoints / f"v{v}").mkdir(parents=True)
        out.add_version(v, "sft", keep=(5, 2), checkpoint=f"v{v}")
        sizes[v] = out.manifest_path.stat().st_size
    m = out.read()
    assert [e["version"] for e in m["versions"]] == [0, 395, 396, 397, 398, 399]
    assert [c["version"] for c in m["checkpoints"]] == [398, 399]
    assert sorted(p.name for p in out.checkpoints.iterdir()) == ["v398", "v399"]
    assert m["pruned_versions"] == [[1, 394]] and out.highest_version() == 399
    assert sizes[399] < sizes[50] * 1.1  # bounded (a version record is ~200 bytes: unbounded would be 8x)
    history = out.version_history()
    assert [e["version"] for e in history] == list(range(400))
    kinds = [json.loads(line).get("kind", "version") for line in out.history_path.read_text().splitlines()]
    assert kinds.count("checkpoint") == 398 and kinds.count("version") == 394


def test_a_manifest_of_the_earlier_layout_moves_its_pruned_records_to_the_history(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    _publish(out, range(0, 4), keep_last=0)
    m = out.read()  # as the earlier layout wrote it: pruned records stayed in the manifest
    m["versions"][1]["pruned"] = True
    (out.path / "weights" / "v000001.pt").unlink()
    out.write(m)
    assert out.prune(0, 3) == {"weights": [], "checkpoints": []}  # nothing deleted, the record moved
    assert out.read()["pruned_versions"] == [[1, 1]] and len(out.history_path.read_text().splitlines()) == 1
    _publish(out, range(4, 6), keep_last=3)
    m = out.read()
    assert [e["version"] for e in m["versions"]] == [0, 3, 4, 5] and m["pruned_versions"] == [[1, 2]]
    assert [e["version"] for e in out.version_history()] == list(range(6))


def test_checkpoints_beyond_the_limit_are_pruned(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    for v in range(4):
        (out.checkpoints / f"v{v}").mkdir(parents=True)
        out.add_checkpoint(v, f"v{v}")
    assert out.prune(0, 2) == {"weights": [], "checkpoints": [0, 1]}
    assert sorted(p.name for p in out.checkpoints.iterdir()) == ["v2", "v3"]
    assert out.latest_checkpoint()["version"] == 3


def test_retention_settings_are_the_limits():
    cfg = ServiceConfig.model_validate({"root": "/r", "limits": {"max_versions_kept": 4, "max_checkpoints_kept": 2}})
    assert (cfg.limits.max_versions_kept, cfg.limits.max_checkpoints_kept) == (4, 2)
    assert cfg.limits_for("any").max_versions_kept == 4
    over = ServiceConfig.model_validate({"root": "/r", "limits": {"max_versions_kept": 4},
                                         "tenant_limits": {"big": {"max_versions_kept": 0}}})
    assert over.limits_for("big").max_versions_kept == 0 and over.limits_for("other").max_versions_kept == 4
    # the old [retention] table is refused naming the limits it was another spelling of (one home)
    with pytest.raises(ValueError, match="retention.keep_last is now limits.max_versions_kept"):
        ServiceConfig.model_validate({"root": "/r", "retention": {"keep_last": 4}})


def test_keep_last_zero_keeps_everything_and_pruning_later_applies_the_rule(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    _publish(out, range(0, 6), keep_last=0)
    assert _on_disk(out) == set(range(6))
    assert out.prune(2, 3)["weights"] == [1, 2, 3] and _on_disk(out) == {0, 4, 5}


def test_an_evaluation_of_a_pruned_version_is_refused(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    _publish(out, range(0, 6), keep_last=2)
    with pytest.raises(NotFound, match="version 2 of 't' has no weights any more"):
        mark_evaluation(str(out.path), "t-eval-9", 2)
    assert not list(out.eval_dir.glob("t-eval-9*"))  # no marker left behind
    assert 2 not in out.evaluated_versions()


def test_an_evaluation_without_its_report_no_longer_keeps_its_version(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    _publish(out, range(0, 6), keep_last=2)
    for job, v in (("t-eval-1", 4), ("t-eval-2", 5), ("t-eval-3", 5)):
        mark_evaluation(str(out.path), job, v)
    (out.eval_dir / "t-eval-2-v000005.json").write_text(json.dumps({"job": "t-eval-2", "version": 5, "episodes": 3}))
    assert unmark_evaluation(str(out.path), "t-eval-1") == [4]  # failed or cancelled: its marker goes
    assert unmark_evaluation(str(out.path), "t-eval-2") == []  # a finished report stays
    _publish(out, range(6, 9), keep_last=2)
    assert _on_disk(out) == {0, 5, 7, 8}  # 4 pruned like any other; 5 kept by two evaluations
    assert unmark_evaluation(str(out.path)) == [5]  # a crashed service's unfinished ones (t-eval-3)
    assert out.evaluated_versions() == {5}  # t-eval-2's report still keeps it


def test_job_history_goes_to_its_own_file(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    history = [{"kind": "train", "step": i, "loss": 1.0 / (i + 1)} for i in range(1, 50)]
    out.add_job({"job": "t-sft-1", "t_submit": 12.5, "state": "done", "history": history})
    rec = out.read()["jobs"][0]
    assert "history" not in rec and rec["history_file"] == "jobs/t-sft-1.json"
    full = json.loads((out.path / rec["history_file"]).read_text())  # the job's record file
    assert full["history"] == history and full["state"] == "done"
    assert out.job_records() == [full]
