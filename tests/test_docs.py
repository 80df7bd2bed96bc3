"""The docs cannot rot: the site builds in strict mode, the generated references list what the code has, links
resolve, and the code examples run.

Which code blocks run is said by an HTML comment on the line before the block's fence (invisible in the rendered
page; the convention is documented in docs/index.md, "How these pages are tested"):

* ``<!-- run -->``: runs for real, alone, in a fresh namespace, from the repository root; needs no service (and
  writes nothing).
* ``<!-- run: service-start -->``: starts the service the ``service`` blocks use (it must bind ``nx``); every such
  block in the docs must be the same text, and it runs once.
* ``<!-- run: service -->``: runs against that service, page by page (README first, then the docs in their
  navigation order), each page in its own namespace seeded with the start block's names, its blocks in order.
* ``<!-- illustrative: why -->``: not run (it needs what a test cannot have: a remote URL, a GPU, another host).

Every ``python`` block carries one of these; a block without one fails the suite. In ``bash`` blocks every
``nexus ...`` command is parsed by the CLI's own parser and every ``make X`` must be a Makefile target.
"""

from __future__ import annotations

import html
import importlib
import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(run|run:\s*service-start|run:\s*service|illustrative:[^>]*)\s*-->\s*$")
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "<", "&"}
# module names of the package layout the docs are written in, aliased to today's module until it exists
@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    mark: str | None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _pages() -> list[Path]:
    """README.md, then the docs' pages in their navigation order."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text().replace("!!python/name:", ""))["nav"]

    def walk(item) -> list[str]:
        if isinstance(item, str):
            return [item]
        if isinstance(item, list):
            return [p for x in item for p in walk(x)]
        return [p for v in item.values() for p in walk(v)]

    return [REPO / "README.md"] + [DOCS / p for p in walk(nav)]


def _blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARKER.search(before)
        kind = re.sub(r"\s+", "", mark.group(1)).split(":")[0] if mark else None
        if mark and mark.group(1).replace(" ", "").startswith("run:"):
            kind = mark.group(1).replace(" ", "")
        out.append(Block(str(path.relative_to(REPO)), text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2),
                         kind))
    return out


ALL = [b for p in _pages() for b in _blocks(p)]
PYTHON = [b for b in ALL if b.lang == "python"]


def test_every_page_in_the_navigation_exists_and_every_page_is_in_it():
    pages = _pages()[1:]
    assert all(p.is_file() for p in pages), [str(p) for p in pages if not p.is_file()]
    on_disk = {p for p in DOCS.rglob("*.md") if "hooks" not in p.parts}
    assert on_disk == set(pages), on_disk ^ set(pages)


def test_every_python_block_says_whether_it_runs():
    unmarked = [b.where for b in PYTHON if b.mark is None]
    assert not unmarked, f"python blocks without <!-- run... --> or <!-- illustrative: ... -->: {unmarked}"
    starts = {b.code for b in PYTHON if b.mark == "run:service-start"}
    assert len(starts) == 1, "the service-start blocks must be one text"
    assert "nx" in compile(starts.pop(), "start", "exec").co_names


def test_readme_is_a_front_door_with_valid_links():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "make demo" in text and "make test" in text
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "a date in the README (history goes to CHANGELOG.md)"
    assert not re.search(r"`[0-9a-f]{7,12}`", text), "a commit hash in the README"
    assert not re.search(r"load average|\bfc-v\d+", text), "run conditions in the README (they go with the run)"
    assert not re.search(r"`[0-9a-f]{7,12}`", (REPO / "CHANGELOG.md").read_text()), "a commit hash in the changelog"
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (REPO / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"README links to missing files: {broken}"


def test_result_commands_name_scripts_that_exist():
    """The results tables' commands point at the experiments' scripts as they are (scripts get renamed)."""
    for page in (REPO / "README.md", DOCS / "results.md"):
        scripts = re.findall(r"python (experiments/\S+?\.py)", page.read_text())
        assert len(scripts) >= 5, page
        missing = sorted({s for s in scripts if not (REPO / s).is_file()})
        assert not missing, f"{page.name}: result commands name missing scripts {missing}"
    folders = set(re.findall(r"`(experiments/\w+/)`", (DOCS / "results.md").read_text()))
    assert len(folders) >= 10 and not sorted(f for f in folders if not (REPO / f).is_dir())


def _results_table(text: str) -> list[str]:
    """The rows of the first table after a "Results" heading (or the page's first table)."""
    start = re.search(r"^#+ Results\s*$", text, re.M)
    lines = text[start.end() if start else 0:].splitlines()
    lines = list(itertools.dropwhile(lambda line: not line.startswith("|"), lines))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines))
    return table[2:]  # past the header and the rule


def test_readme_and_results_page_carry_the_same_figures():
    readme = _results_table((REPO / "README.md").read_text())
    page = _results_table((DOCS / "results.md").read_text())
    assert len(readme) == len(page) >= 8
    bold = [re.findall(r"\*\*([^*]+)\*\*", r) for r in readme]
    assert bold == [re.findall(r"\*\*([^*]+)\*\*", r) for r in page]
    assert not [r for r in readme if "being re-measured" in r], "a results row without its figure"


def test_shell_blocks_name_real_commands():
    from nexus.client.cli import build_parser

    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for b in ALL:
        if b.lang not in ("bash", "sh", "shell"):
            continue
        for line in b.code.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words = list(itertools.takewhile(lambda w: w not in SHELL_OPERATORS, lexer))  # the first command
            if not words:
                continue
            if words[0] == "nexus":
                try:
                    build_parser().parse_args(words[1:])
                except SystemExit:
                    pytest.fail(f"{b.where}: the CLI refuses {line.strip()!r}")
            elif words[0] == "make":
                assert set(words[1:]) <= targets, f"{b.where}: no such make target in {line.strip()!r}"


@pytest.fixture()
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                          "-d", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_strict_with_every_setting_policy_and_route(site):
    hook = _hook()
    config_page = (site / "operator" / "configuration" / "index.html").read_text()
    sections, leaves = [], []

    def walk(model, path=""):
        for name, field in model.model_fields.items():
            sub = hook._model_of(field.annotation)
            key = f"{path}.{name}" if path else name
            if sub is None:
                leaves.append(name)
            else:
                sections.append(key)
                walk(sub, key)

    walk(hook.settings_model())
    assert len(leaves) > 50 and sections
    missing = [k for k in sections if f'id="{hook._anchor(k)}"' not in config_page]
    missing += [n for n in leaves if f"<code>{n}</code>" not in config_page]
    assert not missing, f"settings missing from the configuration reference: {missing}"
    policies = (site / "operator" / "scheduling" / "index.html").read_text()
    shipped = {p.stem: tomllib.loads(p.read_text()) for p in sorted((REPO / "schedulers").glob("*.toml"))}
    assert shipped
    for name, data in shipped.items():  # the generated row: the file's description and its settings
        row = f"<code>{name}</code></td>\n<td>{html.escape(data.get('description', ''), quote=False)}"
        assert row in policies, name
    api = (site / "api" / "index.html").read_text()
    doc = hook.openapi_document()
    assert (site / "api" / "openapi.json").is_file()
    routes = [f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m in ops]
    assert len(routes) > 20
    missing_routes = [r for r in routes if f"<code>{r}</code>" not in api]
    assert not missing_routes, f"routes missing from the HTTP reference: {missing_routes}"


def _run(block: Block, namespace: dict) -> None:
    exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 - the docs' own examples


@pytest.mark.parametrize("block", [b for b in PYTHON if b.mark == "run"], ids=lambda b: b.where)
def test_offline_example_runs(block, monkeypatch):
    monkeypatch.chdir(REPO)
    _run(block, {"__name__": "__docs__"})


@pytest.mark.cluster
def test_service_examples_run_against_one_embedded_service(tmp_path, monkeypatch):
    service = [b for b in PYTHON if b.mark == "run:service"]
    start = next(b for b in PYTHON if b.mark == "run:service-start")
    assert len(service) >= 5
    monkeypatch.chdir(tmp_path)
    seed: dict = {"__name__": "__docs__"}
    _run(start, seed)
    nx = seed["nx"]
    try:
        pages: dict[str, list[Block]] = {}
        for b in service:
            pages.setdefault(b.page, []).append(b)
        for blocks in pages.values():
            namespace = dict(seed)
            for b in blocks:
                _run(b, namespace)
        assert nx.status()["tenants"], "the examples created no tenant"
    finally:
        nx.close()
