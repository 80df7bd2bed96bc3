"""mkdocs hook: the pages generated from the code itself, at build time.

* ``<!-- nexus:config-reference -->`` becomes the configuration reference: every section and setting of the
  service's settings model, walked generically from its pydantic fields (name, type, default, the field's own
  ``description``), so a renamed or regrouped section shows up as it is in the code.
* ``<!-- nexus:http-api -->`` becomes the HTTP API reference, rendered from the OpenAPI document of the
  gateway's FastAPI app. The app is built with a backend that is never connected (no service runs: the
  document is a property of the routes); the document itself is published beside the page as
  ``api/openapi.json``.

The one place the settings model is named is ``SETTINGS`` below (``module:attribute``, the first that imports
wins): the model's home after the package reorganization first, today's second.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

SETTINGS = ("nexus.config.service:ServiceConfig",)  # the service's settings (pydantic)

CONFIG_MARK = "<!-- nexus:config-reference -->"
POLICIES_MARK = "<!-- nexus:scheduling-policies -->"
API_MARK = "<!-- nexus:http-api -->"
_openapi_cache: dict[str, Any] = {}


def _repo_on_path(config: Any) -> None:
    """Import ``nexus`` from this checkout (the repository holding ``mkdocs.yml``)."""
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)


def settings_model() -> type:
    """The service's settings model: the top level of a service file, its sections as nested models."""
    for name in SETTINGS:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ModuleNotFoundError, AttributeError):
            continue
    raise ImportError(f"none of {SETTINGS} names the service's settings model")


# -- the configuration reference ------------------------------------------------------------------------------
def _model_of(annotation: Any) -> type | None:
    """The pydantic model a field holds (also ``Model | None``), else None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return _model_of(models[0])
    return None


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__name__
    text = str(annotation).replace("typing.", "")
    text = re.sub(r"\b(?:[a-z_]+\.)+([A-Za-z_]+)", r"\1", text)  # module prefixes off: nexus.x.Y -> Y
    return text.replace(" | ", " or ")  # no pipe: it would end a table cell


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that takes the validated data
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    if value is None:
        return "unset"
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    try:
        text = json.dumps(value)
    except TypeError:
        text = str(value)
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def _cell(text: str | None) -> str:
    """One table cell: one line, ``|`` escaped, ``<`` outside code spans shown as text (not taken for HTML)."""
    parts = _rst_to_md(" ".join((text or "").split())).split("`")
    parts[::2] = [p.replace("<", "&lt;") for p in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def _rst_to_md(text: str) -> str:
    return re.sub(r"``([^`]+)``", r"`\1`", re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text))


def config_reference(model: type, path: str = "") -> list[str]:
    """Markdown: one table per section of ``model``, nested sections after their parent, depth first."""
    doc = _rst_to_md(" ".join((model.__doc__ or "").split())) if model.__doc__ != _base_doc() else ""
    title = f"`[{path}]` {{#{_anchor(path)}}}" if path else "Top level {#config-top-level}"
    lines = [f"### {title}", ""]
    if doc:
        lines += [doc, ""]
    rows, sections = [], []
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        key = f"{path}.{name}" if path else name
        if sub is not None:
            optional = typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
            note = " (optional: unset by default)" if optional else ""
            rows.append(f"| `{name}` | section [`[{key}]`](#{_anchor(key)}){note} | | {_cell(field.description)} |")
            sections.append((sub, key))
        else:
            rows.append(f"| `{name}` | `{_type_name(field.annotation)}` | {_default(field)} | "
                        f"{_cell(field.description) or '—'} |")
    lines += ["| setting | type | default | what it does |", "|---|---|---|---|", *rows, ""]
    for sub, key in sections:
        lines += config_reference(sub, key)
    return lines


def _base_doc() -> str | None:
    from pydantic import BaseModel

    return BaseModel.__doc__


def _anchor(key: str) -> str:
    """The heading id of section ``key`` (set explicitly through attr_list: ``config-a-b`` for ``[a.b]``)."""
    return "config-" + re.sub(r"[^a-z0-9]+", "-", key.lower()).strip("-")


# -- the scheduling policies shipped in schedulers/ -------------------------------------------------------------
def scheduling_policies(folder: Path) -> list[str]:
    """Markdown: one row per policy file, its description and every setting it makes (flattened keys)."""
    import tomllib

    def flat(table: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for k, v in table.items():
            if isinstance(v, dict):
                out += flat(v, f"{prefix}{k}.")
            elif k != "description":
                out.append(f"`{prefix}{k} = {json.dumps(v)}`")
        return out

    lines = ["| policy | what | settings |", "|---|---|---|"]
    for path in sorted(folder.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        lines.append(f"| `{path.stem}` | {_cell(data.get('description', ''))} | {', '.join(flat(data))} |")
    return lines


# -- the HTTP API reference ------------------------------------------------------------------------------------
def openapi_document() -> dict[str, Any]:
    """The gateway's OpenAPI document, from its FastAPI app built around a backend that is never connected."""
    if "doc" not in _openapi_cache:
        from nexus.gateway.app import create_app
        from nexus.gateway.auth import TokenStore
        from nexus.gateway.backend import Backend

        with tempfile.TemporaryDirectory(prefix="nexus-docs-") as root:
            # port 9 (discard): never dialled, the app's lifespan (which connects) does not run here
            app = create_app(settings_model()(root=root), Backend("tcp://127.0.0.1:9"), TokenStore(root + "/gateway"))
            _openapi_cache["doc"] = app.openapi()
    return _openapi_cache["doc"]


def _schema_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#schema-{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_schema_type(s) for s in schema[key])
    if schema.get("type") == "array":
        return f"array of {_schema_type(schema.get('items', {}))}"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    return schema.get("type", "any")


def http_reference(doc: dict[str, Any]) -> list[str]:
    lines = [f"Generated from the gateway's OpenAPI document ({doc['info']['title']}, API version "
             f"{doc['info']['version']}); the document itself: [openapi.json](openapi.json). A running gateway "
             "serves the same document at `/openapi.json` and an explorer at `/docs`.", ""]
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            by_tag.setdefault((op.get("tags") or ["other"])[0], []).append((path, method, op))
    for tag, ops in by_tag.items():
        lines += [f"## {tag[:1].upper() + tag[1:]}", ""]
        for path, method, op in ops:
            lines += [f"### `{method.upper()} {path}`", "", f"**{op.get('summary', '')}**"
                      + ("  (bearer token)" if op.get("security") else "  (no token)"), ""]
            if op.get("description"):
                lines += [_rst_to_md(op["description"]), ""]
            params = op.get("parameters", [])
            if params:
                lines += ["| parameter | in | type | required |", "|---|---|---|---|"]
                lines += [f"| `{p['name']}` | {p['in']} | {_schema_type(p.get('schema', {}))} | "
                          f"{'yes' if p.get('required') else 'no'} |" for p in params]
                lines.append("")
            body = op.get("requestBody", {}).get("content", {})
            for ctype, media in body.items():
                lines += [f"Body ({ctype}): {_schema_type(media.get('schema', {}))}", ""]
            lines += ["| status | meaning |", "|---|---|"]
            for status, resp in op.get("responses", {}).items():
                lines.append(f"| {status} | {_cell(resp.get('description'))} |")
            lines.append("")
    lines += ["## Schemas", ""]
    for name, schema in doc.get("components", {}).get("schemas", {}).items():
        lines += [f"### {name} {{#schema-{name.lower()}}}", ""]
        if schema.get("description"):
            lines += [_cell(schema["description"]), ""]
        props = schema.get("properties", {})
        if props:
            required = set(schema.get("required", []))
            lines += ["| field | type | required | description |", "|---|---|---|---|"]
            lines += [f"| `{k}` | {_schema_type(v)} | {'yes' if k in required else 'no'} | "
                      f"{_cell(v.get('description'))} |" for k, v in props.items()]
            lines.append("")
    return lines


# -- mkdocs events ---------------------------------------------------------------------------------------------
def on_config(config: Any) -> Any:
    _repo_on_path(config)
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, "api/openapi.json", content=json.dumps(openapi_document(), indent=1)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CONFIG_MARK in markdown:
        markdown = markdown.replace(CONFIG_MARK, "\n".join(config_reference(settings_model())))
    if POLICIES_MARK in markdown:
        folder = Path(config.config_file_path).resolve().parent / "schedulers"
        markdown = markdown.replace(POLICIES_MARK, "\n".join(scheduling_policies(folder)))
    if API_MARK in markdown:
        markdown = markdown.replace(API_MARK, "\n".join(http_reference(openapi_document())))
    return markdown
