"""The cluster-manager files under deploy/ cannot rot: every `nexus` command in the Kubernetes manifest, the
SLURM batch script and the dask-jobqueue example parses with the CLI's own argparse parser, every role has its
command, and the manifest is consistent (operator CRDs wired to one cluster, `$(VAR)`s defined, volumes mounted,
the service config valid, actor replicas = actor_ranks). The image (the Dockerfile, parsed) and the deployments
agree: built by `make setup`, the `nexus` entry point, the ports the processes listen on, the root / scratch
volumes, WORKDIR and user. No Kubernetes cluster, SLURM or container runtime needed."""

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
from nexus.config.service import ServiceConfig

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


# -- the image (Dockerfile) against the manifests: no container runtime ------------------------------------
REPO = DEPLOY.parent


def _instr(key: str) -> list[str]:
    """The arguments of each ``key`` instruction of the Dockerfile (dockerfile-parse: continuations joined)."""
    from dockerfile_parse import DockerfileParser

    return [i["value"] for i in DockerfileParser(path=str(REPO / "Dockerfile")).structure if i["instruction"] == key]


def _words(rest: str) -> list[str]:
    """An instruction's arguments, in JSON (exec) form or shell words."""
    import json

    return json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def _image_facts() -> dict:
    from dockerfile_parse import DockerfileParser

    df = DockerfileParser(path=str(REPO / "Dockerfile"))
    (workdir,) = _instr("WORKDIR")
    (user,) = _instr("USER")
    return {"base": df.baseimage, "workdir": workdir, "uid": int(user.split(":")[0]), "gid": int(user.split(":")[1]),
            "volumes": {v for rest in _instr("VOLUME") for v in _words(rest)},
            "expose": {int(p.split("/")[0]) for rest in _instr("EXPOSE") for p in rest.split()},
            "path": df.envs.get("PATH", "").split(":"), "entrypoint": _words(_instr("ENTRYPOINT")[-1]),
            "args": df.args}


def _setup_cfg() -> dict:
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    scripts = dict(ln.split("=", 1) for ln in cfg["options.entry_points"]["console_scripts"].strip().splitlines())
    return {"name": cfg["metadata"]["name"], "version": cfg["metadata"]["version"],
            "scripts": {k.strip(): v.strip() for k, v in scripts.items()}}


def _dockerignored(path: str) -> bool:
    import fnmatch

    rules = [r.strip() for r in (REPO / ".dockerignore").read_text().splitlines() if r.strip() and r[0] != "#"]
    parts = Path(path).parts
    return any(fnmatch.fnmatch("/".join(parts[:i]), r.removeprefix("**/")) or
               fnmatch.fnmatch(parts[i - 1], r.removeprefix("**/")) for r in rules for i in range(1, len(parts) + 1))


def test_image_is_built_by_the_readme_setup_with_a_cuda_build_argument():
    runs = _instr("RUN")
    setup = [r for r in runs if "make setup" in r]
    assert len(setup) == 1, "the image must install through `make setup`, as the README does"
    assert not any("pip install" in r for r in runs), "the Dockerfile repeats pins the Makefile owns"
    facts = _image_facts()
    assert facts["args"]["TORCH_VARIANT"] == "cpu", "CPU torch unless a CUDA build is asked for"
    assert "${TORCH_VARIANT}" in facts["args"]["TORCH_INDEX"] and "TORCH_INDEX=${TORCH_INDEX}" in setup[0]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^TORCH_INDEX \?=\s*$", makefile, re.M), "without the argument make uses the local index"
    torch_line = next(ln for ln in makefile.splitlines() if "pip install" in ln and "torch==" in ln)
    assert "$(TORCH_INDEX)" in torch_line
    py = re.search(r"^PY \?= (python\d\.\d+)", makefile, re.M).group(1)
    assert f"PY={py}" in setup[0] and facts["base"].startswith(f"python:{py.removeprefix('python')}-")
    # what `make setup` reads is in the build context; local state is not
    for need in ("Makefile", "setup.cfg", "pyproject.toml", "scripts/install_system.sh", "scripts/constraints.txt",
                 "nexus/__init__.py", "configs/service.toml"):
        assert (REPO / need).exists() and not _dockerignored(need), f"{need} must reach the image"
    for local in (".venv/bin/python", ".git/HEAD", "runs/local/service.json", "nexus/__pycache__/x.pyc"):
        assert _dockerignored(local), f"{local} must not be copied into the image"


def test_manifests_run_the_image_and_its_entry_point():
    meta, facts = _setup_cfg(), _image_facts()
    image = f"{meta['name']}:{meta['version']}"
    # `nexus` is a console script of the package, importable, and on the image's PATH (the venv make creates)
    module, _, func = meta["scripts"]["nexus"].partition(":")
    assert callable(getattr(importlib.import_module(module), func))
    assert facts["path"][0] == f"{facts['workdir']}/.venv/bin" and facts["entrypoint"] == ["nexus"]
    for doc in _manifest():
        for pod in _pod_specs(doc):
            for c in pod["containers"]:
                assert c["image"] == image, f"{doc['metadata']['name']} runs {c['image']}, the image is {image}"
                assert c["command"][0] in meta["scripts"]
    # SLURM: every nexus command runs in the image, in its WORKDIR (where configs/ resolve)
    text = (DEPLOY / "slurm" / "nexus.sbatch").read_text()
    in_image = shlex.split(re.search(r"^IN_IMAGE=\((.*)\)$", text, re.M).group(1))
    assert in_image[:2] == ["apptainer", "exec"] and in_image[in_image.index("--pwd") + 1] == facts["workdir"]
    assert re.search(rf"^NEXUS_IMAGE=\$\{{NEXUS_IMAGE:-{meta['name']}-{meta['version']}\.sif\}}", text, re.M)
    calls = [ln for ln in text.replace("\\\n", " ").splitlines() if re.search(r"\bnexus (scheduler|gateway|worker)\b",
                                                                              ln) and not ln.lstrip().startswith("#")]
    assert len(calls) == 5 and all('"${IN_IMAGE[@]}" nexus ' in ln for ln in calls)
    config = re.search(r"^NEXUS_CONFIG=\$\{NEXUS_CONFIG:-(\S+)\}", text, re.M).group(1)
    assert (REPO / config).is_file() and not _dockerignored(config)
    ex = _jobqueue_example()
    prefix = ex.in_image("w.sif", "/shared/root")
    assert prefix[:2] == ["apptainer", "exec"] and prefix[prefix.index("--pwd") + 1] == facts["workdir"]


def _containers() -> list[tuple[dict, dict, dict, object]]:
    """(doc, pod, container, parsed nexus command) of every container in the manifest."""
    out = []
    for doc in _manifest():
        for pod in _pod_specs(doc):
            for c in pod["containers"]:
                out.append((doc, pod, c, parse_nexus([str(a) for a in c["args"]], c["name"])))
    return out


def test_manifest_ports_are_the_ports_the_processes_listen_on():
    from nexus.config.service import ServiceConfig as _Cfg
    from nexus.deploy import hosts as deploy

    expose = _image_facts()["expose"]
    services = {d["metadata"]["name"]: d for d in _manifest() if d["kind"] == "Service"}
    for doc, _pod, c, a in _containers():
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        declared = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        if a.cmd == "scheduler":
            listens = {a.port, int((a.dashboard or f"x:{deploy.DASHBOARD_PORT}").rsplit(":", 1)[1])}
            assert a.port == deploy.SCHEDULER_PORT  # workers and gateways find it by scheduler.json, clients by this
            service_ports = doc["spec"]["scheduler"]["service"]["ports"]
        elif a.cmd == "gateway":
            # the config's gateway_port is 0 (any free port): a deployment must pin it
            assert _Cfg.model_fields["gateway_port"].default == 0 and a.port, f"{where}: the gateway needs --port"
            listens = {a.port}
            service_ports = services[doc["metadata"]["name"]]["spec"]["ports"]
        else:
            assert not declared, f"{where}: workers find the scheduler, nothing connects to a declared port"
            continue
        assert set(declared.values()) == listens, f"{where} declares {declared}, the process listens on {listens}"
        assert {declared[p["targetPort"]] for p in service_ports} == listens, f"{where}: its Service targets " \
                                                                               "ports the process does not open"
        for probe in ("readinessProbe", "livenessProbe"):
            port = c.get(probe, {}).get("httpGet", c.get(probe, {}).get("tcpSocket", {})).get("port")
            assert port is None or port in declared, f"{where}: {probe} on an undeclared port {port}"
        assert listens <= expose, f"the image does not EXPOSE {sorted(listens - expose)}"
    sbatch = _script_commands((DEPLOY / "slurm" / "nexus.sbatch").read_text())
    (gw,) = [parse_nexus(c, "nexus.sbatch") for c in sbatch if c[0] == "gateway"]
    assert gw.port in expose


def test_manifest_paths_are_the_image_volumes_workdir_and_user():
    facts = _image_facts()
    for doc, pod, c, a in _containers():
        where = f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}"
        ctx = pod["securityContext"]
        assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (facts["uid"], facts["gid"], facts["gid"]), \
            f"{where} runs as another user than the image's (who owns /nexus and /scratch there)"
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        (root_mount,) = [path for name, path in mounts.items() if name in claims]
        assert root_mount in facts["volumes"], f"{where}: the shared root is mounted at {root_mount}, not a VOLUME"
        assert Path(a.root).is_relative_to(root_mount), f"{where}: --root {a.root} is outside its volume"
        if getattr(a, "scratch", None) is not None:
            assert a.scratch in mounts.values() and a.scratch in facts["volumes"], f"{where}: scratch not mounted"
        if getattr(a, "config", None) is not None:
            assert any(Path(a.config).is_relative_to(m) for m in mounts.values()), f"{where}: --config not mounted"
    assert facts["workdir"] not in facts["volumes"], "a volume over the WORKDIR would hide the installed service"
