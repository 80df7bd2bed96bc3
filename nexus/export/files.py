"""The files of an exported policy directory (format ``joynexus-policy``; ``nexus.export.policy`` writes and loads
it): their names, the manifest and its check. No torch, no model: a client verifies a downloaded export with
it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from nexus.errors import NotFound, SpecError

FORMAT = "joynexus-policy"
FORMAT_VERSION = 1
MANIFEST, BACKBONE, HEAD, ADAPTER = "manifest.json", "backbone.json", "head.safetensors", "adapter"
PREPROCESSOR, NORMALIZATION, README = "preprocessor.json", "normalization.json", "README.md"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_policy_dir(path: str | Path) -> bool:
    p = Path(path) / MANIFEST
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def read_manifest(path: str | Path, verify_files: bool = True) -> dict[str, Any]:
    """The manifest of a policy directory; with ``verify_files`` every listed file's sha256 is checked."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise NotFound(f"{str(path)!r} is not an exported policy directory (no {MANIFEST})")
    try:
        m = json.loads((path / MANIFEST).read_text())
    except ValueError as e:
        raise SpecError(f"{str(path / MANIFEST)!r} is not valid JSON: {e}") from None
    if m.get("format") != FORMAT:
        raise SpecError(f"{str(path)!r}: format {m.get('format')!r}, expected {FORMAT!r}")
    if m.get("format_version") != FORMAT_VERSION:
        raise SpecError(f"{str(path)!r}: format version {m.get('format_version')!r}; this JoyNexus reads "
                        f"version {FORMAT_VERSION}")
    if verify_files:
        for name, digest in m["files"].items():
            f = path / name
            if not f.is_file():
                raise SpecError(f"exported policy {str(path)!r} is incomplete: {name} is missing")
            if sha256_file(f) != digest:
                raise SpecError(f"exported policy {str(path)!r}: {name} does not match its sha256 in the "
                                "manifest (modified or corrupted)")
    return m


