"""Retention of version weights: the newest N, plus the initial, every checkpointed and every evaluated one."""

from __future__ import annotations

import json

import pytest

from nexus.data.output_dir import TenantOutputDir, mark_evaluation
from nexus.errors import NotFound


def _publish(out: TenantOutputDir, versions: range, keep_last: int) -> None:
    for v in versions:  # what the actor does per version: write the head, record it, prune
        out.weights_path(v).parent.mkdir(parents=True, exist_ok=True)
        out.weights_path(v).write_bytes(b"w" * 16)
        out.add_version(v, "test", keep_last=keep_last)


def _on_disk(out: TenantOutputDir) -> set[int]:
    return {int(p.stem[1:]) for p in (out.path / "weights").glob("v*.pt")}


def test_keeps_last_n_checkpointed_evaluated_and_initial(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    _publish(out, range(0, 10), keep_last=3)
    assert _on_disk(out) == {0, 7, 8, 9}
    out.add_checkpoint(9, "v9")
    mark_evaluation(str(out.path), "t-eval-1", 8)  # an evaluation starts on version 8
    _publish(out, range(10, 20), keep_last=3)
    assert _on_disk(out) == {0, 8, 9, 17, 18, 19}
    m = out.read()
    pruned = {e["version"] for e in m["versions"] if e.get("pruned")}
    assert pruned == set(range(20)) - {0, 8, 9, 17, 18, 19}  # the manifest says what is gone
    assert len(m["versions"]) == 20  # the history of versions stays complete


def test_keep_last_zero_keeps_everything_and_pruning_later_applies_the_rule(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    _publish(out, range(0, 6), keep_last=0)
    assert _on_disk(out) == set(range(6))
    assert out.prune_weights(2) == [1, 2, 3] and _on_disk(out) == {0, 4, 5}


def test_an_evaluation_of_a_pruned_version_is_refused(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    _publish(out, range(0, 6), keep_last=2)
    with pytest.raises(NotFound, match="version 2 of 't' has no weights any more"):
        mark_evaluation(str(out.path), "t-eval-9", 2)
    assert not list(out.eval_dir.glob("t-eval-9*"))  # no marker left behind
    assert 2 not in out.evaluated_versions()


def test_job_history_goes_to_its_own_file(tmp_path):
    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    history = [{"kind": "train", "step": i, "loss": 1.0 / (i + 1)} for i in range(1, 50)]
    out.add_job({"job": "t-sft-1", "t_submit": 12.5, "state": "done", "history": history})
    rec = out.read()["jobs"][0]
    assert "history" not in rec and rec["history_file"] == "jobs/t-sft-1-12500.json"
    assert json.loads((out.path / rec["history_file"]).read_text()) == history
