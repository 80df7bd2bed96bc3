"""File routes: a tenant's output dir, listed and read (never outside it)."""

from __future__ import annotations

import asyncio
import os
import stat
from typing import Any, BinaryIO

from fastapi import APIRouter
from fastapi.responses import Response

from nexus.config.paths import confine
from nexus.errors import Forbidden, NotFound, SpecError, quote
from nexus.gateway.routes.common import FILE_CHUNK, GW, Who
from nexus.gateway.state import FileBytes

router = APIRouter()


@router.get("/v1/tenants/{tenant}/files", tags=["files"])
async def list_files(tenant: str, who: Who, gw: GW) -> dict[str, Any]:
    """The tenant's output dir (manifest, weights, eval reports, trajectories, checkpoints)."""
    who.may_act_on(tenant)
    root = (await gw.backend.tenant_view(tenant))["output_dir"]
    return {"files": await asyncio.to_thread(_list_files, root)}


@router.get("/v1/tenants/{tenant}/files/{path:path}", tags=["files"], response_class=FileBytes,
         responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                              "format": "binary"}}}}})
async def read_file(tenant: str, path: str, who: Who, gw: GW) -> Response:
    """One file of the tenant's output dir; paths leaving it (``..``, symlinks) are refused."""
    who.may_act_on(tenant)
    root = (await gw.backend.tenant_view(tenant))["output_dir"]
    f = await asyncio.to_thread(_open_file, root, path)
    size = os.fstat(f.fileno()).st_size

    def chunks():  # streamed from the opened file: never whole in memory (checkpoints can be large)
        with f:
            while block := f.read(FILE_CHUNK):
                yield block

    return FileBytes(chunks(), headers={"Content-Length": str(size)})


def _list_files(root: str) -> list[dict[str, Any]]:
    out = []
    base = confine(root, root)
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]
        for f in files:
            p = os.path.join(dirpath, f)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                out.append({"path": os.path.relpath(p, base), "bytes": st.st_size})
    return sorted(out, key=lambda x: x["path"])


def _open_file(root: str, rel: str) -> BinaryIO:
    """The opened regular file at ``rel`` inside ``root`` (not through a symlink)."""
    if rel.startswith("/") or "\x00" in rel:
        raise SpecError(f"path {quote(rel)}: give a path relative to the tenant's output dir")
    if ".." in rel.split("/"):
        raise Forbidden(f"path {quote(rel)}: '..' is not allowed")
    path = confine(os.path.join(root, rel), root, must_exist=True)
    if os.path.isdir(path):
        raise SpecError(f"path {quote(rel)} is a directory; GET .../files lists them")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except IsADirectoryError:
        raise SpecError(f"path {quote(rel)} is a directory") from None
    except OSError as e:
        raise NotFound(f"no file {quote(rel)} ({e.strerror})") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise SpecError(f"path {quote(rel)} is not a regular file")
    return f
