"""Paths the service owns: where a tenant's output dir may be, and private files (0600) and dirs (0700).

Two kinds of checks, because the scheduler never touches the file system:

* :func:`resolve_output_dir` is lexical (no I/O): the scheduler and the gateway derive a tenant's dir
  from its name (``root/tenants/<name>``) or confine a spec's ``output_dir`` to ``output_base``, and
  refuse a dir that is, contains or lies inside another tenant's.
* :func:`confine` walks the real file system component by component without following symlinks; the
  worker that creates the dir and the gateway that serves files from it call it, so a symlink planted
  inside a base cannot lead out of it.

Service processes also run with ``umask 077`` (:func:`harden_process`), so files written by libraries
(Arrow, DeepSpeed, MLflow) are private too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from nexus.errors import Forbidden, NotFound, SpecError

FILE_MODE = 0o600
DIR_MODE = 0o700


def harden_process() -> None:
    """Files and dirs this process creates are readable by the service's user only."""
    os.umask(0o077)


def private_mkdir(path: str | Path) -> Path:
    """``mkdir -p`` whose new components are 0700."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(p, DIR_MODE)  # mkdir's mode is filtered by the umask
    return path


def private_write_bytes(path: str | Path, data: bytes) -> None:
    """Atomic write (temporary name, then rename) of a 0600 file."""
    path = Path(path)
    private_mkdir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def tenant_default_dir(tenants_dir: str | Path, name: str) -> str:
    return os.path.normpath(os.path.join(os.path.abspath(tenants_dir), name))


def _inside(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")


def resolve_output_dir(name: str, requested: str | None, tenants_dir: str | Path, output_base: str | None,
                       others: Iterable[tuple[str, str]] = ()) -> str:
    """The output dir of tenant ``name`` (lexical checks only; see :func:`confine` for symlinks).

    ``others``: (tenant, output dir) of every other known tenant. Without ``output_base`` a spec may only
    name the default dir; with it, ``requested`` (absolute, or relative to the base) must stay inside the
    base, outside the service's own tenants dir except for its own default, and apart from every other
    tenant's dir.
    """
    default = tenant_default_dir(tenants_dir, name)
    if requested is None or requested == "":
        path = default
    else:
        if "\x00" in requested:
            raise SpecError("invalid tenant spec: output_dir contains a NUL byte")
        if output_base is None:
            path = os.path.normpath(os.path.abspath(requested))
            if path != default:
                raise Forbidden(f"output_dir {requested!r} refused: tenants' output dirs are owned by the service "
                                f"({default}); an operator may allow a base folder with output_base")
        else:
            base = os.path.normpath(os.path.abspath(output_base))
            raw = requested if os.path.isabs(requested) else os.path.join(base, requested)
            path = os.path.normpath(raw)
            if not _inside(path, base) or path == base:
                raise Forbidden(f"output_dir {requested!r} refused: it must lie inside the output base {base}")
            tdir = os.path.normpath(os.path.abspath(tenants_dir))
            if _inside(path, tdir) and path != default:
                raise Forbidden(f"output_dir {requested!r} refused: it lies in the service's tenants folder "
                                f"{tdir} but is not {name!r}'s own dir")
    for other, odir in others:
        if other == name:
            continue
        odir = os.path.normpath(odir)
        if _inside(path, odir) or _inside(odir, path):
            raise Forbidden(f"output_dir {path!r} refused: it overlaps the output dir of another tenant")
    return path


def confine(path: str | Path, base: str | Path, *, must_exist: bool = False) -> Path:
    """``path`` if it lies inside ``base`` with no symlink on the way (from ``base`` down), else Forbidden.

    ``base`` itself is resolved once (it is the operator's choice); every component below it is
    checked with ``lstat``. Missing components are fine unless ``must_exist``.
    """
    base_real = Path(os.path.realpath(base))
    rel = PurePosixPath(os.path.normpath(os.path.abspath(path)))
    base_lex = PurePosixPath(os.path.normpath(os.path.abspath(base)))
    try:
        parts = rel.relative_to(base_lex).parts
    except ValueError:
        try:
            parts = rel.relative_to(PurePosixPath(base_real)).parts
        except ValueError:
            raise Forbidden(f"path {str(path)!r} lies outside {str(base)!r}") from None
    cur = base_real
    for i, part in enumerate(parts):
        if part in ("..", ""):
            raise Forbidden(f"path {str(path)!r}: '..' is not allowed")
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            if must_exist:
                raise NotFound(f"no file {'/'.join(parts)!r}") from None
            return cur.joinpath(*parts[i + 1:])
        if stat.S_ISLNK(st.st_mode):
            raise Forbidden(f"path {str(path)!r}: {'/'.join(parts[:i + 1])!r} is a symbolic link")
    return cur


def dir_bytes(path: str | Path) -> int:
    """Bytes of the regular files below ``path`` (symlinks not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total
