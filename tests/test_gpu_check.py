"""The GPU check script (experiments/gpu_check/run.py) on this CPU machine: it says there is no CUDA and skips every
check with the reason; its --dry-run-cpu path runs each check's code on the CPU with tiny presets, so a broken
check fails here before a GPU is ever lent; a failing check is recorded and the others go on; the time budget
skips what is left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu_check" / "run.py"
CHECKS = ("grouped_forward", "lora_mixed", "zero_ranks", "sim_beside_engine", "predict_latency")


def run(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[int, dict, str]:
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, json.loads(out.read_text()), proc.stdout + proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path is a CPU host's; a CUDA host runs the checks")
def test_cpu_host_skips_every_check_with_the_reason(tmp_path: Path) -> None:
    rc, report, log = run(tmp_path)
    assert rc == 0, log
    assert "no CUDA here" in log
    assert report["mode"] == "no-cuda" and report["complete"] is True
    assert report["host"]["torch"] == torch.__version__ and report["host"]["device_name"] == "cpu"
    assert set(report["checks"]) == set(CHECKS)
    for name, check in report["checks"].items():
        assert "no CUDA device" in check["skipped"], name
        assert "ok" not in check


def test_dry_run_cpu_runs_every_check(tmp_path: Path) -> None:
    rc, report, log = run(tmp_path, "--dry-run-cpu")
    assert rc == 0, log
    assert report["mode"] == "dry-run-cpu" and report["complete"] is True and report["plan"]["size"] == "tiny"
    checks = report["checks"]
    assert all(checks[name].get("ok") is True for name in CHECKS), {k: v.get("error") for k, v in checks.items()}
    fam = checks["grouped_forward"]["families"]
    assert set(fam) == {"groot", "oft", "pi"}
    assert all(f["backbone_calls_grouped"] == 1 and f["forward_grouped_ms"] > 0 for f in fam.values())
    lora = checks["lora_mixed"]
    assert lora["weights_finite_after_steps"] and lora["train_grouped_ms"] > 0 and lora["lora_rank"] == 8
    zero = checks["zero_ranks"]
    # the same global batch on 2 ranks as on 1: ZeRO-2's update is the same up to fp32 reduction order
    assert zero["backend"] == "gloo" and zero["relative_weight_error"] < 1e-5
    sim = checks["sim_beside_engine"]
    assert sim["sim_step_alone_ms"] > 0 and sim["sim_step_concurrent_ms"] > 0
    assert sim["engine_contention_factor"] > 0
    pred = checks["predict_latency"]
    assert pred["calls"] == 1 and pred["predict_median_ms"] > 0 and pred["backbone"] == "qwen3vl tiny"


def test_a_failing_check_is_recorded_and_the_others_go_on(tmp_path: Path) -> None:
    rc, report, log = run(tmp_path, "--dry-run-cpu", "--size", "no-such-preset",
                          "--only", "lora_mixed", "predict_latency")
    assert rc == 1, log  # a dry run's failure is a bug in a check
    checks = report["checks"]
    assert checks["lora_mixed"]["ok"] is False and "no-such-preset" in checks["lora_mixed"]["error"]
    assert checks["lora_mixed"]["traceback"]
    assert checks["predict_latency"]["ok"] is True  # its preset (--predict-size) is still tiny
    assert checks["grouped_forward"] == {"skipped": "not selected (--only)"}


def test_a_spent_budget_skips_what_is_left(tmp_path: Path) -> None:
    rc, report, log = run(tmp_path, "--dry-run-cpu", "--budget-s", "0")
    assert rc == 0, log
    for name in CHECKS:
        assert "time budget" in report["checks"][name]["skipped"], name
