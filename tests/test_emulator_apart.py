"""The emulator is a tool apart (issue 51): no production module imports ``nexus.emulator`` or names an emulator
parameter — not even in a comment — and production plugs it in through one seam, ``nexus.wire.devices``, whose
default is the real devices. The project's check, which must print nothing, is

    grep -rlE 'emulat|ahead_s|lend_actor|lend_inference' nexus --include='*.py' \\
        | grep -vE 'emulat[a-z_]*/|/emulat[a-z_]*\\.py$'

these tests are that check, and the same rule read from the imports (scripts/structure.py)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMES = re.compile(r"emulat|ahead_s|lend_actor|lend_inference")
APART = re.compile(r"emulat[a-z_]*/|/emulat[a-z_]*\.py$")


def naming_the_emulator(package: Path) -> list[str]:
    """The production files that name the emulator (the grep above, in Python: every ``*.py`` under ``package``
    outside the emulator's own package)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        if not APART.search(rel) and NAMES.search(path.read_text()):
            out.append(rel)
    return out


@pytest.fixture(scope="module")
def structure():
    spec = importlib.util.spec_from_file_location("structure", ROOT / "scripts" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["structure"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("structure", None)


def test_no_production_module_names_an_emulator_parameter():
    assert naming_the_emulator(ROOT / "nexus") == []
    assert (ROOT / "nexus" / "emulator" / "settings.py").exists()  # the check looks where the emulator is


def test_no_production_module_imports_the_emulator(structure):
    modules = structure.load()
    assert any(name.startswith("nexus.emulator.") for name in modules)
    importers = sorted(f"{m.name} imports {target}" for m in modules.values()
                       if not m.name.startswith("nexus.emulator")
                       for target in m.imports if target == "nexus.emulator" or target.startswith("nexus.emulator."))
    assert importers == []
    assert structure.violations(modules) == []
    assert all("emulator" in FORBIDDEN for layer, FORBIDDEN in structure.FORBIDDEN.items() if layer != "emulator")


def test_the_checks_see_a_production_module_that_names_or_imports_the_emulator(structure, tmp_path, monkeypatch):
    """They can fail: a throwaway package whose top-level module and control module reach into the emulator, and a
    service module whose comment names a lending setting."""
    pkg = tmp_path / "nexus"
    for d in (pkg, pkg / "config", pkg / "control", pkg / "control" / "jobs", pkg / "sim", pkg / "emulator"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text("")
    (pkg / "emulator" / "settings.py").write_text("lend_actor = False\n")
    (pkg / "config" / "service.py").write_text("from nexus.emulator import settings\n")
    (pkg / "control" / "jobs" / "flows.py").write_text("def f():\n    import nexus.emulator.settings\n")
    (pkg / "sim" / "host.py").write_text("x = 1  # a device lent (lend_actor)\n")
    assert naming_the_emulator(pkg) == ["nexus/config/service.py", "nexus/control/jobs/flows.py", "nexus/sim/host.py"]
    monkeypatch.setattr(structure, "ROOT", tmp_path)
    monkeypatch.setattr(structure, "PACKAGE", pkg)
    assert structure.violations(structure.load()) == ["nexus.config.service:1 imports nexus.emulator.settings",
                                                      "nexus.control.jobs.flows:2 imports nexus.emulator.settings"]


def test_the_seam_defaults_to_the_real_devices_and_the_service_never_loads_the_emulator():
    code = ("import sys, nexus.worker.plugin, nexus.engine.host, nexus.sim.tasks, "
            "nexus.control.plugin, nexus.client.cli, nexus.deploy.local; from nexus.wire import devices; "
            "print(type(devices.installed()).__name__, any(m.startswith('nexus.emulator') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["RealDevices", "False"]
