"""Per-tenant trajectory storage as Arrow IPC files (one immutable file per appended batch).

Layout: ``<root>/v<policy_version:08d>-<time_ns>-<uuid>.arrow`` where ``root`` is the tenant's
trajectory folder (``TenantOutputDir(...).trajectories``). Files are written under a temporary
name and hard-linked into place, so readers never see a partial file and an existing file is never
overwritten. Reads are memory-mapped (zero-copy for the fixed-size list columns); a version-range
scan uses a ``pyarrow.dataset`` filter, which is how the training queue drops stale rollouts.

Uncompressed IPC on purpose: compression would defeat memory mapping, and dictionary encoding is
applied to the tenant column only (encoding float columns makes writes several times slower).

Optional ``feature`` column (:data:`FEATURE_COLUMN`): the pooled frozen-backbone feature [H] float32
each step's action was computed from, stored by rollouts so the PPO update need not run the backbone
again; the batch metadata names the backbone (``feature_key``). Readers that want the plain
trajectory schema (scans, datasets) drop it (:func:`without_cached_features`).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads

from nexus.features import CameraSpec, Observation, TenantSchema
from nexus.wire.messages import BatchRef

__all__ = [
    "BatchRef",
    "FEATURE_COLUMN",
    "SCHEMA_METADATA_KEY",
    "batch_metadata",
    "TrajectoryStore",
    "arrays_to_observations",
    "columns_to_table",
    "image_columns",
    "read_ipc",
    "scan_trajectories",
    "schema_from_arrow",
    "table_arrays",
    "table_to_observations",
    "trajectory_schema",
    "without_cached_features",
    "write_ipc",
]

SCHEMA_METADATA_KEY = b"nexus.tenant_schema"
BATCH_METADATA_KEY = b"nexus.batch"
FEATURE_COLUMN = "feature"
IMAGE_PREFIX = "image."
SUFFIX = ".arrow"

# per-step scalar columns and their numpy/arrow types
_SCALARS: dict[str, tuple[type, pa.DataType]] = {
    "episode": (np.int64, pa.int64()),
    "step": (np.int32, pa.int32()),
    "reward": (np.float32, pa.float32()),
    "terminated": (np.bool_, pa.bool_()),
    "truncated": (np.bool_, pa.bool_()),
    "success": (np.bool_, pa.bool_()),
    "logprob": (np.float32, pa.float32()),
    "value": (np.float32, pa.float32()),
    "policy_version": (np.int64, pa.int64()),
}


def _schema_json(schema: TenantSchema) -> str:
    return json.dumps({
        "proprio_dim": schema.proprio_dim,
        "action_dim": schema.action_dim,
        "instruction": schema.instruction,
        "cameras": [{"name": c.name, "height": c.height, "width": c.width} for c in schema.cameras],
    }, sort_keys=True)


def trajectory_schema(schema: TenantSchema, feature_dim: int | None = None) -> pa.Schema:
    """The Arrow schema of a tenant's trajectory rows; the TenantSchema rides along as metadata.

    ``feature_dim``: with the optional cached-feature column of that width (last)."""
    fields = [
        pa.field("tenant", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("episode", pa.int64(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("state", pa.list_(pa.float32(), schema.proprio_dim), nullable=False),
    ]
    fields += [pa.field(f"{IMAGE_PREFIX}{c.name}", pa.list_(pa.uint8(), c.height * c.width * 3),
                        nullable=False) for c in schema.cameras]
    fields.append(pa.field("action", pa.list_(pa.float32(), schema.action_dim), nullable=False))
    fields += [pa.field(k, t, nullable=False) for k, (_, t) in _SCALARS.items()
               if k not in ("episode", "step")]
    if feature_dim is not None:
        fields.append(pa.field(FEATURE_COLUMN, pa.list_(pa.float32(), feature_dim), nullable=False))
    return pa.schema(fields, metadata={SCHEMA_METADATA_KEY: _schema_json(schema)})


def without_cached_features(table: pa.Table) -> pa.Table:
    """The table in the plain trajectory schema (the optional feature column dropped)."""
    return table.drop_columns([FEATURE_COLUMN]) if FEATURE_COLUMN in table.column_names else table


def batch_metadata(table: pa.Table) -> dict[str, Any]:
    """The batch metadata a :class:`TrajectoryStore` wrote (rows, versions, feature_key, ...); {} if none."""
    meta = table.schema.metadata or {}
    return json.loads(meta[BATCH_METADATA_KEY]) if BATCH_METADATA_KEY in meta else {}


def schema_from_arrow(arrow_schema: pa.Schema) -> TenantSchema:
    """The TenantSchema stored in a trajectory table's metadata."""
    meta = arrow_schema.metadata or {}
    if SCHEMA_METADATA_KEY not in meta:
        raise ValueError("not a trajectory table: its Arrow schema has no 'nexus.tenant_schema' metadata")
    d = json.loads(meta[SCHEMA_METADATA_KEY])
    return TenantSchema(proprio_dim=int(d["proprio_dim"]), action_dim=int(d["action_dim"]),
                        cameras=tuple(CameraSpec(c["name"], int(c["height"]), int(c["width"]))
                                      for c in d["cameras"]),
                        instruction=d.get("instruction", ""))


class TrajectoryStore:
    """The trajectories of one tenant: batch files directly in ``root`` (created on first append).

    Safe for concurrent appenders (different processes) on one local filesystem: every batch gets
    a unique file and appears atomically.
    """

    def __init__(self, root: str | Path, tenant: str, schema: TenantSchema) -> None:
        self.dir = Path(root)
        self.tenant = tenant
        self.schema = schema
        self.arrow_schema = trajectory_schema(schema)

    # ---- writing -------------------------------------------------------------------------------
    def append(self, columns: Mapping[str, np.ndarray], feature_key: str | None = None) -> BatchRef:
        """Write one batch of per-step columns (see :func:`columns_to_table`) as a new IPC file.

        A ``feature`` column needs ``feature_key``, the backbone that computed it."""
        if (FEATURE_COLUMN in columns) != (feature_key is not None):
            raise ValueError("a feature column and its feature_key come together")
        table = columns_to_table(columns, self.schema, self.tenant)
        n = table.num_rows
        if n == 0:
            raise ValueError("refusing to store an empty batch")
        versions = table.column("policy_version").to_numpy()
        version = int(versions.min())
        ref_meta = {"rows": n, "episodes": int(len(np.unique(table.column("episode").to_numpy()))),
                    "policy_version": version, "max_policy_version": int(versions.max()),
                    "tenant": self.tenant, "feature_key": feature_key}
        table = table.replace_schema_metadata({**self.arrow_schema.metadata,
                                               BATCH_METADATA_KEY: json.dumps(ref_meta)})
        name = f"v{version:08d}-{time.time_ns()}-{uuid.uuid4().hex[:12]}{SUFFIX}"
        path = write_ipc(table, self.dir / name)
        return BatchRef(path=str(path), rows=n, episodes=ref_meta["episodes"], policy_version=version,
                        tenant=self.tenant)

    # ---- reading -------------------------------------------------------------------------------
    def read(self, ref: BatchRef | Mapping[str, Any]) -> pa.Table:
        """The rows of one batch, memory-mapped."""
        if not isinstance(ref, BatchRef):
            ref = BatchRef.from_dict(ref)
        if ref.tenant != self.tenant:
            raise ValueError(f"batch of tenant {ref.tenant!r} read from the store of {self.tenant!r}")
        table = read_batch(ref)
        self._check_schema(table.schema, ref.path)
        return table

    def scan(self, min_version: int | None = None, max_version: int | None = None) -> pa.Table:
        """All stored rows whose ``policy_version`` lies in ``[min_version, max_version]``."""
        files = [str(p) for p in self._files()
                 if max_version is None or _name_version(p) <= max_version]  # names carry the min version
        if not files:
            return self.arrow_schema.empty_table()
        dataset = pads.dataset(files, schema=self.arrow_schema, format="arrow")
        cond = None
        if min_version is not None:
            cond = pads.field("policy_version") >= min_version
        if max_version is not None:
            upper = pads.field("policy_version") <= max_version
            cond = upper if cond is None else cond & upper
        return dataset.to_table(filter=cond).replace_schema_metadata(self.arrow_schema.metadata)

    def batches(self) -> list[BatchRef]:
        """Every stored batch, ordered by policy version then write time."""
        refs = []
        for path in self._files():
            with pa.memory_map(str(path), "r") as source:
                meta = json.loads(pa.ipc.open_file(source).schema.metadata[BATCH_METADATA_KEY])
            refs.append(BatchRef(path=str(path), rows=meta["rows"], episodes=meta["episodes"],
                                 policy_version=meta["policy_version"], tenant=meta["tenant"]))
        return refs

    def _files(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.iterdir() if p.suffix == SUFFIX and not p.name.startswith("."))

    def _check_schema(self, schema: pa.Schema, where: str) -> None:
        if FEATURE_COLUMN in schema.names:
            i = schema.get_field_index(FEATURE_COLUMN)
            ftype = schema.field(i).type
            if not (pa.types.is_fixed_size_list(ftype) and ftype.value_type == pa.float32()):
                raise ValueError(f"{where}: column 'feature' is not a fixed-size float32 list")
            schema = schema.remove(i)
        if not schema.equals(self.arrow_schema, check_metadata=False):
            raise ValueError(f"{where}: columns do not match the trajectory schema of tenant {self.tenant!r}")


def scan_trajectories(source: str | Path | list[str | Path], schema: TenantSchema,
                      tenants: str | list[str] | None = None, min_version: int | None = None,
                      max_version: int | None = None) -> pa.Table:
    """Rows of trajectory files filtered by tenant and policy version, as one table.

    ``source`` is a folder (searched recursively for ``*.arrow``, e.g. a service's ``tenants/``
    folder holding several tenants' stores) or a list of files. Files of other tenants are skipped
    from their batch metadata without being read; the filter itself runs in ``pyarrow.dataset``.
    Every file read must have ``schema``'s columns.
    """
    if isinstance(source, (str, Path)):
        root = Path(source)
        files = sorted(p for p in root.rglob(f"*{SUFFIX}") if not p.name.startswith(".")) if root.is_dir() else []
    else:
        files = [Path(p) for p in source]
    wanted = {tenants} if isinstance(tenants, str) else set(tenants) if tenants is not None else None
    arrow_schema = trajectory_schema(schema)
    keep = []
    for path in files:
        meta = pa.ipc.open_file(pa.memory_map(str(path), "r")).schema.metadata or {}
        if wanted is not None and BATCH_METADATA_KEY in meta:
            if json.loads(meta[BATCH_METADATA_KEY])["tenant"] not in wanted:
                continue
        keep.append(str(path))
    if not keep:
        return arrow_schema.empty_table()
    cond = None
    for expr in ((pads.field("tenant").isin(sorted(wanted)) if wanted is not None else None),
                 (pads.field("policy_version") >= min_version if min_version is not None else None),
                 (pads.field("policy_version") <= max_version if max_version is not None else None)):
        if expr is not None:
            cond = expr if cond is None else cond & expr
    dataset = pads.dataset(keep, schema=arrow_schema, format="arrow")
    return dataset.to_table(filter=cond).replace_schema_metadata(arrow_schema.metadata)


def columns_to_table(columns: Mapping[str, np.ndarray], schema: TenantSchema, tenant: str) -> pa.Table:
    """Validate per-step columns and build a table with :func:`trajectory_schema`.

    ``tenant`` may be omitted from ``columns`` (filled in); keys starting with ``ep_`` (per-episode
    summaries from ``collect_episodes``) are ignored; an optional ``feature`` column [N, H] adds the
    cached-feature column; any other unknown key, a missing column, a wrong shape, float values for
    an integer column or non-uint8 images raise ``ValueError``.
    """
    feature = columns.get(FEATURE_COLUMN)
    feature_dim = None
    if feature is not None:
        feature = np.asarray(feature)
        if feature.ndim != 2 or not np.issubdtype(feature.dtype, np.floating):
            raise ValueError(f"column 'feature': float [N, H] expected, got {feature.dtype} {feature.shape}")
        feature_dim = int(feature.shape[1])
    arrow_schema = trajectory_schema(schema, feature_dim)
    cols = {k: v for k, v in columns.items() if not k.startswith("ep_")}
    cols.setdefault("tenant", None)
    expected = set(arrow_schema.names)
    unknown, missing = set(cols) - expected, expected - set(cols)
    if unknown or missing:
        raise ValueError(f"trajectory columns mismatch: unknown {sorted(unknown)}, missing {sorted(missing)}")
    n = len(np.asarray(cols["episode"]))
    shapes = {"state": ((schema.proprio_dim,), np.float32), "action": ((schema.action_dim,), np.float32)}
    if feature_dim is not None:
        shapes[FEATURE_COLUMN] = ((feature_dim,), np.float32)
    shapes.update({f"{IMAGE_PREFIX}{c.name}": ((c.height, c.width, 3), np.uint8) for c in schema.cameras})
    arrays: list[pa.Array] = []
    for field in arrow_schema:
        name = field.name
        if name == "tenant":
            arrays.append(_tenant_column(cols["tenant"], n, tenant))
            continue
        arr = np.asarray(cols[name])
        if name in _SCALARS:
            if arr.shape != (n,):
                raise ValueError(f"column {name!r}: shape {arr.shape}, expected ({n},)")
            arrays.append(pa.array(_cast(arr, _SCALARS[name][0], name), type=field.type))
            continue
        shape, dtype = shapes[name]
        if arr.shape != (n, *shape):
            raise ValueError(f"column {name!r}: shape {arr.shape}, expected {(n, *shape)}")
        if dtype is np.uint8 and arr.dtype != np.uint8:
            raise ValueError(f"column {name!r}: images must be uint8, got {arr.dtype}")
        flat = np.ascontiguousarray(_cast(arr, dtype, name)).reshape(-1)
        arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat), int(np.prod(shape))))
    return pa.Table.from_arrays(arrays, schema=arrow_schema)


def _tenant_column(values: Any, n: int, tenant: str) -> pa.Array:
    if values is not None:
        vals = np.asarray(values)
        if vals.shape != (n,):
            raise ValueError(f"column 'tenant': shape {vals.shape}, expected ({n},)")
        bad = set(map(str, np.unique(vals.astype(str)))) - {tenant}
        if bad:
            raise ValueError(f"rows of tenant(s) {sorted(bad)} in a batch of tenant {tenant!r}")
    indices = pa.array(np.zeros(n, np.int32))
    return pa.DictionaryArray.from_arrays(indices, pa.array([tenant], pa.string()))


def write_ipc(table: pa.Table, path: str | Path, *, overwrite: bool = False, compression: str | None = None) -> Path:
    """Write ``table`` as one Arrow IPC file, atomically (temporary name, then link/rename).

    Without ``overwrite`` an existing file is never replaced (``FileExistsError``). ``compression``
    ("zstd", "lz4") shrinks image-heavy files ~5x (rendered frames compress well) at the price of
    zero-copy reads: meant for datasets kept in a repository, not for rollouts.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        options = pa.ipc.IpcWriteOptions(compression=compression)
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema, options=options) as writer:
            writer.write_table(table)
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic and refuses an existing name, unlike rename
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _name_version(path: Path) -> int:
    return int(path.name[1:].split("-", 1)[0])


def _cast(arr: np.ndarray, dtype: type, name: str) -> np.ndarray:
    if arr.dtype == dtype:
        return arr
    if np.issubdtype(arr.dtype, np.floating) and not np.issubdtype(dtype, np.floating):
        raise ValueError(f"column {name!r}: {arr.dtype} values for an integer/bool column")
    return arr.astype(dtype)


def read_ipc(path: str | Path) -> pa.Table:
    # the memory map stays alive as long as the table's buffers reference it
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def read_batch(ref: BatchRef) -> pa.Table:
    """A batch's rows: its one file, or its files one after another (a batch split over rollout tasks; the
    first file's metadata)."""
    tables = [read_ipc(p) for p in ref.paths]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _fixed_list_to_numpy(col: pa.ChunkedArray | pa.Array, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if len(arr) == 0:
        return np.zeros((0, *shape), dtype)
    # flatten() honours slice offsets; zero-copy when the table is one memory-mapped chunk
    return arr.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(len(arr), *shape)


def table_arrays(table: pa.Table) -> dict[str, np.ndarray]:
    """Numpy columns of a trajectory table, keyed like ``collect_episodes`` output.

    state [N, P] float32, action [N, A] float32, ``image.<camera>`` [N, H, W, 3] uint8 (see
    :func:`image_columns` for a camera-keyed view), tenant [N] str, and the per-step scalars.
    """
    schema = schema_from_arrow(table.schema)
    out: dict[str, np.ndarray] = {
        "tenant": table.column("tenant").cast(pa.string()).to_numpy().astype(object),
        "state": _fixed_list_to_numpy(table.column("state"), (schema.proprio_dim,), np.float32),
        "action": _fixed_list_to_numpy(table.column("action"), (schema.action_dim,), np.float32),
    }
    for c in schema.cameras:
        out[f"{IMAGE_PREFIX}{c.name}"] = _fixed_list_to_numpy(
            table.column(f"{IMAGE_PREFIX}{c.name}"), (c.height, c.width, 3), np.uint8)
    for name, (dtype, _) in _SCALARS.items():
        out[name] = table.column(name).to_numpy().astype(dtype, copy=False)
    if FEATURE_COLUMN in table.column_names:
        col = table.column(FEATURE_COLUMN)
        out[FEATURE_COLUMN] = _fixed_list_to_numpy(col, (col.type.list_size,), np.float32)
    return out


def image_columns(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``{camera: uint8 [N, H, W, 3]}`` from trajectory columns."""
    return {k.removeprefix(IMAGE_PREFIX): v for k, v in arrays.items() if k.startswith(IMAGE_PREFIX)}


def arrays_to_observations(arrays: Mapping[str, np.ndarray], schema: TenantSchema) -> list[Observation]:
    """One :class:`Observation` per row of trajectory columns (views into the column arrays)."""
    state = np.asarray(arrays["state"], np.float32)
    if state.ndim != 2 or state.shape[1] != schema.proprio_dim:
        raise ValueError(f"state shape {state.shape}, expected (N, {schema.proprio_dim})")
    images = image_columns(arrays)
    missing = {c.name for c in schema.cameras} - set(images)
    if missing:
        raise ValueError(f"missing image columns for cameras {sorted(missing)}")
    cams = [c.name for c in schema.cameras]
    # a per-row "instruction" column (LeRobot tasks) overrides the schema's single instruction
    texts = arrays.get("instruction")
    return [Observation(state=state[i], images={c: images[c][i] for c in cams},
                        instruction=str(texts[i]) if texts is not None else schema.instruction)
            for i in range(state.shape[0])]


def table_to_observations(table: pa.Table, schema: TenantSchema) -> list[Observation]:
    """One :class:`Observation` per row of a trajectory table."""
    stored = schema_from_arrow(table.schema)
    if (stored.proprio_dim, stored.cameras) != (schema.proprio_dim, schema.cameras):
        raise ValueError(f"table schema {stored} does not match {schema}")
    return arrays_to_observations(table_arrays(table), schema)


def episode_stats(columns: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Mean return, success rate (success at any step), episodes and steps of per-step columns.

    Works on :func:`collect_episodes` output, on ``table_arrays`` of stored trajectories and on
    offline-dataset arrays alike: it only needs the episode, reward and success columns.
    """
    episode = np.asarray(columns["episode"])
    steps = int(episode.shape[0])
    if steps == 0:
        return {"episodes": 0, "steps": 0, "mean_return": float("nan"), "success_rate": float("nan"),
                "mean_length": float("nan")}
    ids, inverse, lengths = np.unique(episode, return_inverse=True, return_counts=True)
    returns = np.bincount(inverse, weights=np.asarray(columns["reward"], np.float64), minlength=len(ids))
    success = np.bincount(inverse, weights=np.asarray(columns["success"], np.float64), minlength=len(ids)) > 0
    return {
        "episodes": int(len(ids)),
        "steps": steps,
        "mean_return": float(returns.mean()),
        "success_rate": float(success.mean()),
        "mean_length": float(lengths.mean()),
    }

