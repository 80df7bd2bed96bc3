"""Offline (SFT) datasets from the catalog: our Arrow trajectory files or LeRobot datasets.

A dataset is declared by a manifest ``datasets/<name>.toml`` (see ``datasets/README.md``):

* ``format = "arrow"``: folders of Arrow IPC files in :func:`nexus.data.trajectory_store.trajectory_schema`,
  so demonstrations recorded through the Environment Service and RL trajectories share one format
  (a manifest may point at a service's tenant folders and filter rows by tenant and policy version).
  Files are memory-mapped.
* ``format = "lerobot"``: a LeRobot dataset folder (v2.0 / v2.1 / v3.0, ours or anyone's, any local
  path); frame columns are read at once, camera frames are decoded per episode on demand and kept in
  a bounded cache.

Batches are sampled statelessly (a pure function of ``step`` and ``seed``) so an SFT producer can
resume or be restarted in place without replaying a random generator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from nexus.config.catalog import CatalogError, DatasetEntry
from nexus.data.lerobot_format import DONE, REWARD, SUCCESS, TRUNCATED, LeRobotDataset, camera_feature
from nexus.data.trajectory_store import (
    SUFFIX,
    arrays_to_observations,
    episode_stats,
    read_ipc,
    scan_trajectories,
    schema_from_arrow,
    table_arrays,
    trajectory_schema,
    without_cached_features,
)
from nexus.features import Observation, TenantSchema

__all__ = ["DatasetMissingError", "OfflineDataset"]


class DatasetMissingError(FileNotFoundError):
    """A catalog dataset whose data files are not on disk (they are generated, not downloaded)."""


class OfflineDataset:
    """Rows of a catalog dataset with a deterministic, episode-level train / held-out split.

    ``successful_only`` (default) keeps only episodes that reached success at some step: recorders
    keep failed episodes in the files, flagged by their ``success`` column, for analysis; SFT
    should not imitate them. (A LeRobot dataset without a ``next.success`` feature is taken as
    successful demonstrations.) The last ``heldout_fraction`` of the kept episodes (by episode id,
    at least one when there are two or more) form the held-out split.
    """

    def __init__(self, entry: DatasetEntry, heldout_fraction: float = 0.1,
                 successful_only: bool = True, image_cache_mb: int = 512) -> None:
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError("heldout_fraction must be in [0, 1)")
        self.entry = entry
        self._frames: _LeRobotFrames | None = None
        if entry.format == "arrow":
            self._arrays = _load_arrow(entry)
        elif entry.format == "lerobot":
            self._arrays, self._frames = _load_lerobot(entry, image_cache_mb)
        else:
            raise CatalogError(f"dataset {entry.name!r}: unsupported format {entry.format!r} (arrow, lerobot)")
        self._check_unique_steps()

        episode = self._arrays["episode"]
        episodes = np.unique(episode)
        if successful_only:
            episodes = np.unique(episode[self._arrays["success"]])
        n_held = int(round(heldout_fraction * len(episodes)))
        if heldout_fraction > 0 and len(episodes) >= 2:
            n_held = max(1, n_held)
        self.train_episodes = episodes[: len(episodes) - n_held]
        self.heldout_episodes = episodes[len(episodes) - n_held:]
        self.train_rows = np.flatnonzero(np.isin(episode, self.train_episodes))
        self.heldout_rows = np.flatnonzero(np.isin(episode, self.heldout_episodes))
        if len(self.train_rows) == 0:
            raise ValueError(f"dataset {entry.name!r}: no training rows (episodes kept: {len(episodes)})")

    def _check_unique_steps(self) -> None:
        key = self._arrays["episode"].astype(np.int64) * (1 << 32) + self._arrays["step"]
        if len(np.unique(key)) != len(key):
            raise ValueError(f"dataset {self.entry.name!r}: duplicate (episode, step) rows; files must use "
                             "disjoint episode ids (the generator's --episode-offset)")

    @property
    def schema(self) -> TenantSchema:
        return self.entry.schema

    @property
    def num_rows(self) -> int:
        """Rows in use (train + held-out)."""
        return len(self.train_rows) + len(self.heldout_rows)

    def recorded_stats(self) -> dict[str, float]:
        """Episode statistics of everything in the files, failed episodes included."""
        return episode_stats(self._arrays)

    def sample_batch(self, batch_size: int, step: int, seed: int) -> dict[str, np.ndarray]:
        """Training rows for SFT step ``step``: epochs of seeded permutations of the train split.

        A pure function of (batch_size, step, seed); every train row appears once per epoch.
        """
        if batch_size < 1 or step < 0:
            raise ValueError("batch_size must be >= 1 and step >= 0")
        n = len(self.train_rows)
        start = step * batch_size
        picks = []
        for epoch in range(start // n, (start + batch_size - 1) // n + 1):
            perm = np.random.default_rng((seed, epoch)).permutation(n)
            lo, hi = max(start - epoch * n, 0), min(start + batch_size - epoch * n, n)
            picks.append(perm[lo:hi])
        return self._take(self.train_rows[np.concatenate(picks)])

    def heldout(self) -> dict[str, np.ndarray]:
        """All held-out rows, in storage order."""
        return self._take(self.heldout_rows)

    def train(self) -> dict[str, np.ndarray]:
        """All training rows, in storage order."""
        return self._take(self.train_rows)

    def observations(self, arrays: Mapping[str, np.ndarray]) -> list[Observation]:
        """One :class:`Observation` per row of a batch (instruction: the row's LeRobot task, else the manifest's)."""
        return arrays_to_observations(arrays, self.schema)

    def rows(self, arrays: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
        """One observation per row in the service's one observation layout (:mod:`nexus.wire.inputs`: ``state``,
        ``images`` ``{camera: uint8 [H, W, 3]}`` where the dataset has cameras, ``instruction``): what
        ``predict``, ``predict_batch``, a ``forward_backward`` batch and an export's ``predict_action`` take as
        they are, and what an environment session answers. (The columns of :meth:`sample_batch` are the storage
        layout of the trajectory files: ``state``, ``action``, ``image.<camera>``, ...)"""
        return [{"state": o.state, **({"images": o.images} if o.images else {}), "instruction": o.instruction}
                for o in self.observations(arrays)]

    def _take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        out = {k: v[rows] for k, v in self._arrays.items()}
        if self._frames is not None:
            out.update(self._frames.take(self._arrays["episode"], self._arrays["step"], rows))
        return out


def _missing(entry: DatasetEntry, what: str) -> DatasetMissingError:
    how = f"`python {entry.generator}`" if entry.generator else "its generator (or point the manifest's path at it)"
    return DatasetMissingError(f"dataset {entry.name!r}: {what}; regenerate it with {how}")


def _load_arrow(entry: DatasetEntry) -> dict[str, np.ndarray]:
    """All rows of the dataset's Arrow files (memory-mapped), after the manifest's tenant/version filter."""
    expected = trajectory_schema(entry.schema)
    if entry.filter:
        flt = entry.filter
        table = scan_trajectories(entry.path, entry.schema, tenants=flt.get("tenant"),
                                  min_version=flt.get("min_version"), max_version=flt.get("max_version"))
        if table.num_rows == 0:
            raise _missing(entry, f"no rows in {entry.path} match the filter {flt}")
        return table_arrays(table)
    files = sorted(entry.path.glob(f"*{SUFFIX}")) if entry.path.is_dir() else []
    if not files:
        raise _missing(entry, f"no Arrow files in {entry.path}")
    tables = []
    for f in files:
        t = without_cached_features(read_ipc(f))  # rollouts' cached backbone features are not data
        if not t.schema.equals(expected, check_metadata=False):
            raise ValueError(f"dataset {entry.name!r}: {f} does not match the manifest schema "
                             f"{schema_from_arrow(t.schema) if t.schema.metadata else t.schema}")
        tables.append(t)
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="none")
    return table_arrays(table.replace_schema_metadata(expected.metadata))


def _load_lerobot(entry: DatasetEntry, cache_mb: int) -> tuple[dict[str, np.ndarray], _LeRobotFrames]:
    """Frame columns of a LeRobot dataset mapped to trajectory columns; cameras via a frame cache.

    The manifest's ``[features]`` table names the LeRobot features: ``state`` (one key or a list,
    concatenated; default ``observation.state``), ``action`` (default ``action``) and ``cameras``
    (our camera name -> feature; default ``observation.images.<camera>``).
    """

    if not (entry.path / "meta" / "info.json").is_file():
        raise _missing(entry, f"no LeRobot dataset (meta/info.json) in {entry.path}")
    ds = LeRobotDataset(entry.path)
    schema, feats = entry.schema, entry.features
    state_keys = feats.get("state", "observation.state")
    state_keys = [state_keys] if isinstance(state_keys, str) else list(state_keys)
    state = np.concatenate([ds.column(k).astype(np.float32).reshape(ds.num_frames, -1) for k in state_keys], 1)
    action = ds.column(feats.get("action", "action")).astype(np.float32).reshape(ds.num_frames, -1)
    if state.shape[1] != schema.proprio_dim or action.shape[1] != schema.action_dim:
        raise ValueError(f"dataset {entry.name!r}: LeRobot state {state.shape[1]} / action {action.shape[1]} dims, "
                         f"the manifest declares proprio_dim={schema.proprio_dim} / action_dim={schema.action_dim}")
    cameras = {c.name: feats.get("cameras", {}).get(c.name, camera_feature(c.name)) for c in schema.cameras}
    for c in schema.cameras:
        f = ds.features.get(cameras[c.name])
        if f is None or f["dtype"] not in ("video", "image"):
            raise ValueError(f"dataset {entry.name!r}: camera {c.name!r} -> {cameras[c.name]!r} is not a video/image "
                             f"feature of the LeRobot dataset ({ds.video_keys + ds.image_keys})")
        names = f.get("names") or ["height", "width", "channels"]
        hw = {n: int(v) for n, v in zip(names, f["shape"], strict=False)}
        if (hw.get("height"), hw.get("width")) != (c.height, c.width):
            raise ValueError(f"dataset {entry.name!r}: camera {c.name!r} is {hw}, the manifest declares "
                             f"{c.height}x{c.width}")
    n = ds.num_frames
    episode = ds.column("episode_index").astype(np.int64)
    step = ds.column("frame_index").astype(np.int32)
    last = np.r_[episode[1:] != episode[:-1], True] if n else np.zeros(0, bool)
    names = ds.table.column_names
    success = ds.column(SUCCESS).astype(bool) if SUCCESS in names else last.copy()
    truncated = ds.column(TRUNCATED).astype(bool) if TRUNCATED in names else np.zeros(n, bool)
    done = ds.column(DONE).astype(bool) if DONE in names else last
    arrays: dict[str, np.ndarray] = {
        "tenant": np.full(n, entry.name, dtype=object), "episode": episode, "step": step,
        "state": state, "action": action,
        "reward": ds.column(REWARD).astype(np.float32) if REWARD in names else np.zeros(n, np.float32),
        "terminated": done & ~truncated, "truncated": truncated, "success": success,
        "logprob": np.zeros(n, np.float32), "value": np.zeros(n, np.float32),
        "policy_version": np.zeros(n, np.int64),
    }
    if "task_index" in names and ds.tasks:
        texts = np.array([ds.tasks.get(i, schema.instruction) for i in range(max(ds.tasks) + 1)], dtype=object)
        arrays["instruction"] = texts[ds.column("task_index").astype(np.int64)]
    sizes = {c.name: (c.height, c.width) for c in schema.cameras}
    return arrays, _LeRobotFrames(ds, cameras, sizes, cache_mb)


class _LeRobotFrames:
    """Camera frames of sampled rows, decoded one episode at a time, least recently used evicted."""

    def __init__(self, ds: Any, cameras: dict[str, str], sizes: dict[str, tuple[int, int]], cache_mb: int) -> None:
        self.ds, self.cameras, self.sizes, self.budget = ds, cameras, sizes, cache_mb << 20
        self._cache: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._bytes = 0

    def episode(self, camera: str, episode: int) -> np.ndarray:
        key = (camera, episode)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        frames = self.ds.frames(self.cameras[camera], episode)
        self._cache[key] = frames
        self._bytes += frames.nbytes
        while self._bytes > self.budget and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.nbytes
        return frames

    def take(self, episode: np.ndarray, step: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
        out = {}
        for cam in self.cameras:
            h, w = self.sizes[cam]
            imgs = np.zeros((len(rows), h, w, 3), np.uint8)
            for e in np.unique(episode[rows]):
                sel = np.flatnonzero(episode[rows] == e)
                imgs[sel] = self.episode(cam, int(e))[step[rows[sel]]]
            out[f"image.{cam}"] = imgs
        return out
