"""The package's structure, measured from its own source: layer violations, import cycles, in-function
imports, large classes. `python scripts/structure.py [--json] [--root CHECKOUT]`;
`tests/test_layers.py` holds the rules.

Every `import nexus.…` / `from nexus… import …` counts, at module level, inside a function (a deferred
import still ties the two modules) or under `if TYPE_CHECKING:` (an annotation still says one module
knows the other). `from nexus.x import y` where `nexus.x.y` is a module counts as an import of that module.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nexus"

# tools apart from the service: they depend on nexus, and no production module (any layer, or the top level)
# imports them (issue 51: the emulator plugs in through one seam, nexus.wire.devices)
TOOLS: tuple[str, ...] = ("emulator",)
# the worker side's roles: each runs in worker processes of its own resource (ACTOR, INFER, SIM) or hosts them
ROLES: tuple[str, ...] = ("actor", "engine", "sim", "tracking", "worker")

# layer -> the layers it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "control": (*ROLES, "model", "algorithms", "export", "gateway", "client", *TOOLS),
    **{role: ("control", "gateway", "client", *TOOLS) for role in ROLES},
    "data": ("control", *ROLES, "gateway", "client", *TOOLS),
    "model": ("control", *ROLES, "gateway", "client", *TOOLS),
    "algorithms": ("control", *ROLES, "gateway", "client", *TOOLS),
    "client": ("control", *ROLES, *TOOLS),
    "gateway": ("control", *ROLES, "client", *TOOLS),
    "config": ("control", *ROLES, "gateway", "client", *TOOLS),
    "wire": ("control", *ROLES, "gateway", "client", *TOOLS),
    "export": ("control", *ROLES, "gateway", "client", *TOOLS),
    "deploy": ("control", *ROLES, "client", *TOOLS),
    "emulator": (),  # a tool on top: it may use any layer (the client to start a service, the control plane's rules)
}


@dataclass
class Module:
    name: str
    path: Path
    imports: dict[str, list[int]] = field(default_factory=dict)  # imported module -> lines
    deferred: list[tuple[str, int]] = field(default_factory=list)  # in-function imports of nexus modules
    classes: dict[str, int] = field(default_factory=dict)  # class -> lines


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, level: int, current: str, is_pkg: bool) -> str:
    if level == 0:
        return mod
    base = current.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([mod] if mod else []))


def scan(known: set[str], path: Path) -> Module:
    name = module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    module = Module(name, path)
    is_pkg = path.name == "__init__.py"

    def record(target: str, line: int, in_function: bool) -> None:
        if not (target == "nexus" or target.startswith("nexus.")):
            return
        module.imports.setdefault(target, []).append(line)
        if in_function:
            module.deferred.append((target, line))

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    record(alias.name, child.lineno, in_function)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(child.module or "", child.level, name, is_pkg)
                targets = [f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in known]
                for target in targets or [base]:
                    record(target, child.lineno, in_function)
            if isinstance(child, ast.ClassDef) and not in_function:
                module.classes[child.name] = (child.end_lineno or child.lineno) - child.lineno + 1
            visit(child, inner)

    visit(tree, False)
    return module


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FORBIDDEN) else None


def load() -> dict[str, Module]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {m.name: m for m in (scan(known, p) for p in paths)}


def _edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for m in modules.values():
        targets = set()
        for target in m.imports:
            # `import nexus.a.b` ties to the module itself (packages' own __init__ only when imported as such)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != m.name:
                targets.add(target)
        edges[m.name] = targets
    return edges


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges = _edges(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(found)


def violations(modules: dict[str, Module]) -> list[str]:
    out = []
    for m in modules.values():
        own = layer(m.name)
        for target, lines in m.imports.items():
            other = layer(target)
            if (own and other and other in FORBIDDEN.get(own, ())) or (other in TOOLS and own not in TOOLS):
                out.append(f"{m.name}:{lines[0]} imports {target}")
    return sorted(out)


def report() -> dict:
    modules = load()
    deferred = [f"{m.name}:{line} {target}" for m in modules.values() for target, line in m.deferred]
    return {
        "layer_violations": violations(modules),
        "cycles": cycles(modules),
        "in_function_imports": sorted(deferred),
        "largest_classes": dict(
            sorted(
                ((f"{m.name}.{c}", n) for m in modules.values() for c, n in m.classes.items()),
                key=lambda kv: -kv[1],
            )[:8]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="the whole report as JSON")
    parser.add_argument("--root", type=Path, default=None, help="another checkout to measure (e.g. a git worktree)")
    args = parser.parse_args()
    if args.root is not None:
        global ROOT, PACKAGE
        ROOT, PACKAGE = args.root.resolve(), args.root.resolve() / "nexus"
    r = report()
    if args.json:
        print(json.dumps(r, indent=1))
        return
    print(f"imports against the layers: {len(r['layer_violations'])}")
    for v in r["layer_violations"]:
        print(f"  {v}")
    print(f"import cycles: {len(r['cycles'])}")
    for c in r["cycles"]:
        print(f"  {' <-> '.join(c)}")
    print(f"in-function imports of nexus modules: {len(r['in_function_imports'])}")
    print("largest classes:", ", ".join(f"{k} {v}" for k, v in r["largest_classes"].items()))


if __name__ == "__main__":
    main()
