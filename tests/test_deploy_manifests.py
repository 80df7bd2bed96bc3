"""The cluster-manager files under deploy/ cannot rot: every `nexus` command in the Kubernetes manifest, the
SLURM batch script and the dask-jobqueue example parses with the CLI's own argparse parser, every role has its
command, and the manifest is consistent (operator CRDs wired to one cluster, `$(VAR)`s defined, volumes mounted,
the service config valid, actor replicas = actor_ranks). No Kubernetes cluster or SLURM needed."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from nexus.client.cli import build_parser
from nexus.config import ServiceConfig

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
OPERATOR_VARS = {"DASK_WORKER_NAME", "DASK_SCHEDULER_ADDRESS"}  # set by the Dask operator in its worker pods


def parse_nexus(argv: list[str], where: str):
    """``nexus ARGV`` through the CLI's parser; a usage error fails with argparse's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `nexus {shlex.join(argv)}` is refused by the CLI: {err.getvalue().strip()}")


def _commands(parsed: list) -> set[str]:
    return {a.cmd if a.cmd != "worker" else f"worker:{a.role}" for a in parsed}


# -- Kubernetes --------------------------------------------------------------------------------------------
def _manifest() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, "no manifest under deploy/kubernetes"
    return docs


def _pod_specs(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    if doc["kind"] == "DaskCluster":
        return [spec["scheduler"]["spec"], spec["worker"]["spec"]]
    if doc["kind"] == "DaskWorkerGroup":
        return [spec["worker"]["spec"]]
    if doc["kind"] == "Deployment":
        return [spec["template"]["spec"]]
    return []


def test_kubernetes_manifest_runs_only_commands_the_cli_accepts():
    docs = _manifest()
    parsed = []
    for doc in docs:
        for pod in _pod_specs(doc):
            volumes = {v["name"] for v in pod.get("volumes", [])}
            for c in pod["containers"]:
                where = f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}"
                argv = [*c.get("command", []), *c.get("args", [])]
                assert argv[:1] == ["nexus"], f"{where} runs {argv[:1]}, not a nexus command"
                defined = {e["name"] for e in c.get("env", [])} | OPERATOR_VARS
                used = {v for a in argv for v in re.findall(r"\$\((\w+)\)", a)}
                assert used <= defined, f"{where}: $({sorted(used - defined)}) not defined in its env"
                assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, f"{where}: mounts an undefined volume"
                parsed.append(parse_nexus([str(a) for a in argv[1:]], where))
    assert _commands(parsed) == {"scheduler", "gateway", "worker:sim", "worker:actor", "worker:infer"}
    roots = {a.root for a in parsed}
    assert len(roots) == 1, f"every pod must use the same service root, got {roots}"


def test_kubernetes_manifest_is_one_operator_cluster_with_a_group_per_role_and_a_valid_config():
    docs = _manifest()
    clusters = [d for d in docs if d["kind"] == "DaskCluster"]
    groups = [d for d in docs if d["kind"] == "DaskWorkerGroup"]
    assert len(clusters) == 1 and len(groups) >= 2
    assert all(d["apiVersion"] == "kubernetes.dask.org/v1" for d in clusters + groups)
    name = clusters[0]["metadata"]["name"]
    assert all(g["spec"]["cluster"] == name for g in groups), "a worker group joins another cluster"
    ports = {p["name"] for p in clusters[0]["spec"]["scheduler"]["spec"]["containers"][0]["ports"]}
    service = clusters[0]["spec"]["scheduler"]["service"]
    assert {p["targetPort"] for p in service["ports"]} <= ports
    assert service["selector"]["dask.org/cluster-name"] == name
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for doc in docs:
        for pod in _pod_specs(doc):
            used = {v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim"
                    in v}
            assert used and used <= claims, f"{doc['metadata']['name']}: the shared root's volume is missing"
    # the service config the scheduler reads is a valid ServiceConfig; the actor group has its replicas
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    text = next(iter(maps.values()))["service.toml"]
    config = ServiceConfig.model_validate({**tomllib.loads(text), "root": "/nexus/root"})
    actor = next(g for g in groups if "--role" in (args := g["spec"]["worker"]["spec"]["containers"][0]["args"])
                 and args[args.index("--role") + 1] == "actor")
    assert actor["spec"]["worker"]["replicas"] == config.actor_ranks


# -- SLURM -------------------------------------------------------------------------------------------------
def _script_commands(text: str) -> list[list[str]]:
    """`nexus ...` command lines of a shell script (continuations joined; up to `&`, `;` or a comment)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("#"):
            continue
        words = shlex.split(line, comments=True)
        if "nexus" in words:
            cmd = words[words.index("nexus") + 1:]
            out.append([w for w in cmd[: next((i for i, w in enumerate(cmd) if w in ("&", ";", "&&")), len(cmd))]])
    return out


def test_slurm_batch_script_runs_only_commands_the_cli_accepts():
    text = (DEPLOY / "slurm" / "nexus.sbatch").read_text()
    commands = _script_commands(text)
    parsed = [parse_nexus(c, "deploy/slurm/nexus.sbatch") for c in commands]
    assert _commands(parsed) == {"scheduler", "gateway", "worker:sim", "worker:actor", "worker:infer"}
    assert re.search(r"^#SBATCH --nodes=\d+", text, re.M)


def _jobqueue_example():
    spec = importlib.util.spec_from_file_location("jobqueue_workers", DEPLOY / "slurm" / "jobqueue_workers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # dask_jobqueue is imported only when a job is built
    return module


def test_jobqueue_example_commands_parse_for_every_role():
    ex = _jobqueue_example()
    for role, rank in (("sim", None), ("infer", None), ("actor", 0)):
        argv = ex.nexus_worker_command("/shared/root", role, "/tmp/scratch", "6GiB", rank)
        a = parse_nexus(argv[1:], f"jobqueue_workers.py ({role})")
        assert (a.cmd, a.role, a.rank) == ("worker", role, rank)


def test_jobqueue_example_job_script_runs_the_nexus_worker():
    pytest.importorskip("dask_jobqueue", reason="dask-jobqueue (optional extra `deploy`) is not installed")
    ex = _jobqueue_example()
    argv = ex.nexus_worker_command("/shared/root", "sim", "/tmp/scratch", "6GiB")
    script = ex.worker_job(argv, queue="cpu", cores=2, memory="8GB", walltime="01:00:00",
                           job_name="joynexus-sim").job_script()
    assert "#SBATCH -p cpu" in script and "#SBATCH -J joynexus-sim" in script
    (command,) = _script_commands(script)
    assert parse_nexus(command, "the job script").role == "sim" and command[-1] == "sim-slurm-$SLURM_JOB_ID"
