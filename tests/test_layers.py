"""The package's structure, read from its own source (``scripts/structure.py``): the layers point one way,
no module imports another back (type-only imports count), in-function imports of the project's own modules
stay few. Each rule names what breaks it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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


def test_no_import_points_against_the_layers(structure):
    assert structure.violations(structure.load()) == []


def test_no_import_cycles_among_nexus_modules(structure):
    assert structure.cycles(structure.load()) == []


def test_in_function_imports_of_project_modules_stay_few(structure):
    deferred = structure.report()["in_function_imports"]
    assert len(deferred) <= 20, "\n".join(deferred)


def test_the_checker_sees_a_cycle_and_a_layer_violation(structure, tmp_path, monkeypatch):
    """The rules can fail: a throwaway package with a type-only cycle and a control -> actor import."""
    pkg = tmp_path / "nexus"
    (pkg / "control").mkdir(parents=True)
    (pkg / "actor").mkdir()
    for d in (pkg, pkg / "control", pkg / "actor"):
        (d / "__init__.py").write_text("")
    (pkg / "control" / "a.py").write_text("from nexus.actor import b\n")
    (pkg / "actor" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from nexus.actor import c\n")
    (pkg / "actor" / "c.py").write_text("def f():\n    from nexus.actor import b\n")
    monkeypatch.setattr(structure, "ROOT", tmp_path)
    monkeypatch.setattr(structure, "PACKAGE", pkg)
    modules = structure.load()
    assert structure.violations(modules) == ["nexus.control.a:1 imports nexus.actor.b"]
    assert structure.cycles(modules) == [["nexus.actor.b", "nexus.actor.c"]]
    assert structure.report()["in_function_imports"] == ["nexus.actor.c:2 nexus.actor.b"]


def test_algorithm_configs_and_the_contract_import_no_torch():
    """The control plane validates jobs against the algorithms' configs; the scheduler never imports torch."""
    code = ("import sys, nexus.spec, nexus.config.validation, nexus.wire.messages, nexus.wire.inputs, "
            "nexus.algorithms.ppo, nexus.algorithms.grpo; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
