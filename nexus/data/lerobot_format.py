"""LeRobot dataset format (v2.0 / v2.1 / v3.0 layouts) with pyarrow + PyAV, without the lerobot package.

A LeRobot dataset is a folder of parquet frames, mp4 videos and ``meta/`` JSON / parquet:

* **v2.1** (and v2.0): one parquet and one mp4 per camera per episode —
  ``data/chunk-{c:03d}/episode_{e:06d}.parquet``, ``videos/chunk-{c:03d}/{key}/episode_{e:06d}.mp4``;
  ``meta/info.json``, ``meta/tasks.jsonl``, ``meta/episodes.jsonl``, ``meta/episodes_stats.jsonl``
  (v2.0: ``meta/stats.json``).
* **v3.0**: many episodes per file — ``data/chunk-{c:03d}/file-{f:03d}.parquet``,
  ``videos/{key}/chunk-{c:03d}/file-{f:03d}.mp4`` (episodes back to back, located by their
  ``from_timestamp``/``to_timestamp``); ``meta/info.json``, ``meta/tasks.parquet``,
  ``meta/episodes/chunk-{c:03d}/file-{f:03d}.parquet`` (one row per episode with its file
  locations and statistics), ``meta/stats.json``.

Frame columns: ``observation.state``, ``action``, ``timestamp``, ``frame_index``, ``episode_index``,
``index``, ``task_index``, and what a writer adds (we write ``next.reward``, ``next.done``,
``next.success``, ``next.truncated``). Camera features have dtype ``video`` (mp4, decoded here with
PyAV; h264, AV1, HEVC, ...) or ``image`` (encoded PNG/JPEG bytes inside the parquet).

:func:`write_lerobot` writes trajectory columns (the layout of ``nexus.data.trajectory_store``) in either
layout; :class:`LeRobotDataset` reads any of the three layouts, from our writer or elsewhere.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nexus.features import TenantSchema

__all__ = ["LAYOUTS", "LeRobotDataset", "LeRobotFormatError", "camera_feature", "write_lerobot"]

LAYOUTS = ("v2.1", "v3.0")
STATE, ACTION = "observation.state", "action"
REWARD, DONE, SUCCESS, TRUNCATED = "next.reward", "next.done", "next.success", "next.truncated"
CHUNKS_SIZE = 1000  # episodes (v2.1) or files (v3.0) per chunk folder, LeRobot's default
V21_DATA = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
V30_DATA = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_VIDEO = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V30_EPISODES = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
# PyAV encoder names per info.json codec name (LeRobot's default is AV1 through SVT-AV1)
ENCODERS = {"h264": "libx264", "av1": "libsvtav1", "hevc": "libx265"}


class LeRobotFormatError(ValueError):
    """A folder that is not a readable LeRobot dataset, or data that does not fit it."""


def camera_feature(camera: str) -> str:
    """The LeRobot feature key of one of our cameras."""
    return f"observation.images.{camera}"


# ---- writing -----------------------------------------------------------------------------------

def write_lerobot(root: str | Path, columns: Mapping[str, np.ndarray], schema: TenantSchema, *, fps: int,
                  layout: str = "v3.0", codec: str = "h264", crf: int = 12, robot_type: str = "",
                  overwrite: bool = False) -> Path:
    """Write trajectory columns (episodes contiguous) as a LeRobot dataset in ``layout``.

    Columns as :func:`nexus.sim.environment.collect_episodes` returns them (``state``,
    ``action``, ``image.<camera>``, ``episode``, ``step``, ``reward``, ``terminated``, ``truncated``,
    ``success``). Every episode gets the schema's instruction as its task. Cameras become videos
    (``codec`` h264 / av1 / hevc, yuv420p, a key frame every 2 frames as LeRobot does).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if codec not in ENCODERS:
        raise ValueError(f"codec {codec!r} is not one of {sorted(ENCODERS)}")
    root = Path(root)
    if root.exists():
        if not overwrite:
            raise FileExistsError(f"{root} exists (pass overwrite=True to replace it)")
        shutil.rmtree(root)
    episodes = _split_episodes(columns)
    task = schema.instruction
    video_info = {"video.codec": codec, "video.pix_fmt": "yuv420p", "video.is_depth_map": False,
                  "video.fps": fps, "video.channels": 3, "has_audio": False}
    features: dict[str, Any] = {
        STATE: {"dtype": "float32", "shape": [schema.proprio_dim], "names": None},
        ACTION: {"dtype": "float32", "shape": [schema.action_dim], "names": None},
    }
    for c in schema.cameras:
        features[camera_feature(c.name)] = {
            "dtype": "video", "shape": [c.height, c.width, 3], "names": ["height", "width", "channels"],
            "info": {"video.height": c.height, "video.width": c.width, **video_info}}
    features.update({
        REWARD: {"dtype": "float32", "shape": [1], "names": None},
        DONE: {"dtype": "bool", "shape": [1], "names": None},
        SUCCESS: {"dtype": "bool", "shape": [1], "names": None},
        TRUNCATED: {"dtype": "bool", "shape": [1], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    })
    tables, stats, start = [], [], 0
    for e, rows in enumerate(episodes):
        tables.append(_frame_table(columns, rows, e, start, fps, schema))
        stats.append(_episode_stats(columns, rows, schema))
        start += len(rows)
    info = {"codebase_version": layout, "robot_type": robot_type, "total_episodes": len(episodes),
            "total_frames": start, "total_tasks": 1, "chunks_size": CHUNKS_SIZE, "fps": fps,
            "splits": {"train": f"0:{len(episodes)}"}, "features": features}
    cams = [(c.name, camera_feature(c.name)) for c in schema.cameras]
    (root / "meta").mkdir(parents=True)
    if layout == "v2.1":
        info |= {"total_chunks": max(1, -(-len(episodes) // CHUNKS_SIZE)), "total_videos": len(episodes) * len(cams),
                 "data_path": V21_DATA, "video_path": V21_VIDEO if cams else None}
        for e, (rows, table) in enumerate(zip(episodes, tables, strict=True)):
            fmt = {"episode_chunk": e // CHUNKS_SIZE, "episode_index": e}
            _write_parquet(table, root / V21_DATA.format(**fmt))
            for cam, key in cams:
                _encode(root / V21_VIDEO.format(video_key=key, **fmt), columns[f"image.{cam}"][rows], fps, codec, crf)
        _write_jsonl(root / "meta/tasks.jsonl", [{"task_index": 0, "task": task}])
        _write_jsonl(root / "meta/episodes.jsonl", [{"episode_index": e, "tasks": [task], "length": len(rows)}
                                                    for e, rows in enumerate(episodes)])
        _write_jsonl(root / "meta/episodes_stats.jsonl", [{"episode_index": e, "stats": s}
                                                          for e, s in enumerate(stats)])
    else:
        info |= {"data_files_size_in_mb": 100, "video_files_size_in_mb": 500, "data_path": V30_DATA,
                 "video_path": V30_VIDEO if cams else None}
        loc = {"chunk_index": 0, "file_index": 0}  # our samples are small: one data / video file each
        _write_parquet(pa.concat_tables(tables) if tables else _empty_frames(features), root / V30_DATA.format(**loc))
        for cam, key in cams:
            order = np.concatenate(episodes) if episodes else np.zeros(0, np.int64)
            _encode(root / V30_VIDEO.format(video_key=key, **loc), columns[f"image.{cam}"][order], fps, codec, crf)
        _write_parquet(pa.table({"task_index": pa.array([0], pa.int64()), "task": pa.array([task])}),
                       root / "meta/tasks.parquet")
        _write_parquet(_v30_episodes(episodes, stats, cams, fps, task), root / V30_EPISODES.format(**loc))
        (root / "meta/stats.json").write_text(json.dumps(_aggregate(stats), indent=2))
    (root / "meta/info.json").write_text(json.dumps(info, indent=4))
    return root


def _split_episodes(columns: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Row indices of each episode, in order of appearance; episodes must be contiguous and start at step 0."""
    episode = np.asarray(columns["episode"])
    if len(episode) == 0:
        return []
    starts = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]])
    bounds = np.r_[starts, len(episode)]
    out = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if len(np.unique(episode[starts])) != len(starts):
        raise LeRobotFormatError("episodes must be contiguous in the columns")
    step = np.asarray(columns["step"])
    for rows in out:
        if not np.array_equal(step[rows], np.arange(len(rows))):
            raise LeRobotFormatError(f"episode {episode[rows[0]]}: steps are not 0..{len(rows) - 1}")
    return out


def _frame_table(columns: Mapping[str, np.ndarray], rows: np.ndarray, e: int, start: int, fps: int,
                 schema: TenantSchema) -> pa.Table:
    n = len(rows)
    term, trunc = np.asarray(columns["terminated"])[rows], np.asarray(columns["truncated"])[rows]
    return pa.table({
        STATE: _fixed(np.asarray(columns["state"], np.float32)[rows], schema.proprio_dim),
        ACTION: _fixed(np.asarray(columns["action"], np.float32)[rows], schema.action_dim),
        REWARD: pa.array(np.asarray(columns["reward"], np.float32)[rows]),
        DONE: pa.array(term | trunc),
        SUCCESS: pa.array(np.asarray(columns["success"], bool)[rows]),
        TRUNCATED: pa.array(trunc.astype(bool)),
        "timestamp": pa.array((np.arange(n) / fps).astype(np.float32)),
        "frame_index": pa.array(np.arange(n, dtype=np.int64)),
        "episode_index": pa.array(np.full(n, e, np.int64)),
        "index": pa.array(np.arange(start, start + n, dtype=np.int64)),
        "task_index": pa.array(np.zeros(n, np.int64)),
    })


def _empty_frames(features: Mapping[str, Any]) -> pa.Table:
    return pa.table({k: pa.array([], pa.float32()) for k, f in features.items() if f["dtype"] != "video"})


def _fixed(values: np.ndarray, dim: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(values).reshape(-1)), dim)


def _stat(x: np.ndarray) -> dict[str, list]:
    x = x.astype(np.float64)
    return {"min": x.min(0).tolist(), "max": x.max(0).tolist(), "mean": x.mean(0).tolist(),
            "std": x.std(0).tolist(), "count": [int(x.shape[0])]}


def _episode_stats(columns: Mapping[str, np.ndarray], rows: np.ndarray, schema: TenantSchema) -> dict[str, Any]:
    """Per-episode statistics as LeRobot keeps them (images: per channel in [0, 1], shape [3, 1, 1])."""
    out = {STATE: _stat(np.asarray(columns["state"])[rows]), ACTION: _stat(np.asarray(columns["action"])[rows]),
           REWARD: _stat(np.asarray(columns["reward"])[rows][:, None])}
    for c in schema.cameras:
        px = np.asarray(columns[f"image.{c.name}"])[rows].reshape(-1, 3) / 255.0
        out[camera_feature(c.name)] = {k: (np.asarray(v)[:, None, None].tolist() if k != "count" else v)
                                       for k, v in _stat(px).items()}
        out[camera_feature(c.name)]["count"] = [len(rows)]
    return out


def _aggregate(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Dataset statistics from per-episode ones (count-weighted mean and pooled variance)."""
    if not stats:
        return {}
    out: dict[str, Any] = {}
    for key in stats[0]:
        cnt = np.array([s[key]["count"][0] for s in stats], np.float64)
        mean = np.array([s[key]["mean"] for s in stats], np.float64)
        var = np.array([s[key]["std"] for s in stats], np.float64) ** 2
        w = (cnt / cnt.sum()).reshape(-1, *([1] * (mean.ndim - 1)))
        m = (w * mean).sum(0)
        out[key] = {"min": np.min([s[key]["min"] for s in stats], 0).tolist(),
                    "max": np.max([s[key]["max"] for s in stats], 0).tolist(), "mean": m.tolist(),
                    "std": np.sqrt((w * (var + (mean - m) ** 2)).sum(0)).tolist(), "count": [int(cnt.sum())]}
    return out


def _v30_episodes(episodes: list[np.ndarray], stats: list[dict[str, Any]], cams: list[tuple[str, str]],
                  fps: int, task: str) -> pa.Table:
    lengths = np.array([len(r) for r in episodes], np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    n = len(episodes)
    cols: dict[str, Any] = {
        "episode_index": pa.array(np.arange(n, dtype=np.int64)),
        "tasks": pa.array([[task]] * n, pa.list_(pa.string())),
        "length": pa.array(lengths),
        "data/chunk_index": pa.array(np.zeros(n, np.int64)), "data/file_index": pa.array(np.zeros(n, np.int64)),
        "dataset_from_index": pa.array(starts), "dataset_to_index": pa.array(ends),
    }
    for _, key in cams:  # episodes back to back in one video: their time windows
        cols[f"videos/{key}/chunk_index"] = pa.array(np.zeros(n, np.int64))
        cols[f"videos/{key}/file_index"] = pa.array(np.zeros(n, np.int64))
        cols[f"videos/{key}/from_timestamp"] = pa.array(starts / fps)
        cols[f"videos/{key}/to_timestamp"] = pa.array(ends / fps)
    cols["meta/episodes/chunk_index"] = pa.array(np.zeros(n, np.int64))
    cols["meta/episodes/file_index"] = pa.array(np.zeros(n, np.int64))
    for key in (stats[0] if stats else {}):
        for stat in ("min", "max", "mean", "std", "count"):
            cols[f"stats/{key}/{stat}"] = pa.array([np.asarray(s[key][stat], np.float64).reshape(-1).tolist()
                                                    for s in stats], pa.list_(pa.float64()))
    return pa.table(cols)


def _write_parquet(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _encode(path: Path, frames: np.ndarray, fps: int, codec: str, crf: int) -> None:
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    opts = {"g": "2", "crf": str(crf)}
    if codec == "av1":
        opts |= {"preset": "8", "svtav1-params": "log-level=0"}
    with av.open(str(path), "w") as container:
        stream = container.add_stream(ENCODERS[codec], rate=fps, options=opts)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())


# ---- reading -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class EpisodeInfo:
    index: int
    length: int
    tasks: tuple[str, ...]
    start: int  # first row in :meth:`LeRobotDataset.table`
    location: Mapping[str, Any]  # v3.0: file indices and video time windows of this episode


class LeRobotDataset:
    """A LeRobot dataset on local disk (v2.0 / v2.1 / v3.0), read without the lerobot package.

    ``table`` holds every non-video frame column (all episodes, in episode order); camera frames are
    decoded per episode on demand with :meth:`frames`.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        info_path = self.root / "meta" / "info.json"
        if not info_path.is_file():
            raise LeRobotFormatError(f"{self.root}: no meta/info.json — not a LeRobot dataset")
        self.info: dict[str, Any] = json.loads(info_path.read_text())
        self.version = str(self.info.get("codebase_version", ""))
        if not self.version.startswith(("v2.", "v3.")):
            raise LeRobotFormatError(f"{self.root}: unsupported codebase_version {self.version!r} (v2.x, v3.0)")
        self.fps = float(self.info["fps"])
        self.features: dict[str, Any] = self.info["features"]
        self.video_keys = [k for k, f in self.features.items() if f["dtype"] == "video"]
        self.image_keys = [k for k, f in self.features.items() if f["dtype"] == "image"]
        if self.version.startswith("v3."):
            self.tasks, self.episodes, self.table = self._read_v30()
        else:
            self.tasks, self.episodes, self.table = self._read_v2()
        self._by_index = {e.index: e for e in self.episodes}

    @property
    def num_frames(self) -> int:
        return self.table.num_rows

    def column(self, key: str) -> np.ndarray:
        """A numeric frame column as numpy: [N] for scalars, [N, D] for vectors."""
        if key not in self.table.column_names:
            raise LeRobotFormatError(f"{self.root}: no feature {key!r}; it has {self.table.column_names}")
        col = self.table.column(key).combine_chunks()
        if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type):
            flat = col.flatten().to_numpy(zero_copy_only=False)
            return flat.reshape(len(col), -1) if len(col) else flat.reshape(0, 0)
        return col.to_numpy(zero_copy_only=False)

    def frames(self, key: str, episode: int) -> np.ndarray:
        """All frames of camera feature ``key`` in ``episode``: uint8 [T, H, W, 3]."""
        ep = self._by_index[episode]
        if key in self.image_keys:
            return self._image_frames(key, ep)
        if key not in self.video_keys:
            cams = self.video_keys + self.image_keys
            raise LeRobotFormatError(f"{self.root}: {key!r} is not a camera feature ({cams})")
        ts = self.table.column("timestamp").slice(ep.start, ep.length).to_numpy().astype(np.float64)
        if self.version.startswith("v3."):
            path = self.root / self.info["video_path"].format(video_key=key, **ep.location[key])
            offset = float(ep.location[key]["from_timestamp"])
        else:
            path = self.root / self.info["video_path"].format(
                video_key=key, episode_chunk=ep.index // int(self.info.get("chunks_size", CHUNKS_SIZE)),
                episode_index=ep.index)
            offset = 0.0
        return _decode(path, ts + offset, tolerance=0.5 / self.fps)

    def _image_frames(self, key: str, ep: EpisodeInfo) -> np.ndarray:
        from PIL import Image

        cells = self.table.column(key).slice(ep.start, ep.length).to_pylist()
        out = []
        for cell in cells:
            data = cell["bytes"] if isinstance(cell, dict) else cell
            if data is None and isinstance(cell, dict) and cell.get("path"):
                data = (self.root / cell["path"]).read_bytes()
            out.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), np.uint8))
        return np.stack(out)

    # -- layouts --
    def _frame_files(self, files: list[Path]) -> pa.Table:
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise LeRobotFormatError(f"{self.root}: missing data files, e.g. {missing[0]}")
        tables = [pq.read_table(f) for f in files]
        return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})

    def _read_v2(self) -> tuple[dict[int, str], list[EpisodeInfo], pa.Table]:
        meta = self.root / "meta"
        tasks = {int(r["task_index"]): r["task"] for r in _read_jsonl(meta / "tasks.jsonl")}
        rows = sorted(_read_jsonl(meta / "episodes.jsonl"), key=lambda r: r["episode_index"])
        chunk = int(self.info.get("chunks_size", CHUNKS_SIZE))
        files = [self.root / self.info["data_path"].format(episode_chunk=r["episode_index"] // chunk,
                                                            episode_index=r["episode_index"]) for r in rows]
        table = self._frame_files(files)
        episodes, start = [], 0
        for r in rows:
            episodes.append(EpisodeInfo(int(r["episode_index"]), int(r["length"]), tuple(r.get("tasks", ())),
                                        start, {}))
            start += int(r["length"])
        _check_rows(self.root, table, episodes)
        return tasks, episodes, table

    def _read_v30(self) -> tuple[dict[int, str], list[EpisodeInfo], pa.Table]:
        meta = self.root / "meta"
        t = pq.read_table(meta / "tasks.parquet")
        names = t.column("task" if "task" in t.column_names else "__index_level_0__").to_pylist()
        tasks = dict(zip(map(int, t.column("task_index").to_pylist()), names, strict=True))
        ep_files = sorted((meta / "episodes").glob("chunk-*/file-*.parquet"))
        if not ep_files:
            raise LeRobotFormatError(f"{self.root}: no meta/episodes/chunk-*/file-*.parquet")
        ep = pa.concat_tables([pq.read_table(f) for f in ep_files], promote_options="default")
        ep = ep.sort_by("episode_index").to_pylist()
        locs = sorted({(int(r["data/chunk_index"]), int(r["data/file_index"])) for r in ep})
        table = self._frame_files([self.root / self.info["data_path"].format(chunk_index=c, file_index=f)
                                   for c, f in locs])
        # frames in table order: files in (chunk, file) order, episodes by dataset_from_index
        episodes = []
        for r in ep:
            location = {k: {"chunk_index": int(r[f"videos/{k}/chunk_index"]),
                            "file_index": int(r[f"videos/{k}/file_index"]),
                            "from_timestamp": float(r[f"videos/{k}/from_timestamp"])}
                        for k in self.video_keys}
            episodes.append(EpisodeInfo(int(r["episode_index"]), int(r["length"]), tuple(r.get("tasks") or ()),
                                        int(r["dataset_from_index"]), location))
        index = table.column("index").to_numpy()
        first = int(index[0]) if len(index) else 0
        if not np.array_equal(index, np.arange(first, first + len(index))):
            order = np.argsort(index, kind="stable")  # files may not be in global index order
            table, index = table.take(pa.array(order)), index[order]
            first = int(index[0]) if len(index) else 0
        episodes = [EpisodeInfo(e.index, e.length, e.tasks, e.start - first, e.location) for e in episodes]
        episodes.sort(key=lambda e: e.start)
        _check_rows(self.root, table, episodes)
        return tasks, episodes, table


def _check_rows(root: Path, table: pa.Table, episodes: list[EpisodeInfo]) -> None:
    total = sum(e.length for e in episodes)
    if table.num_rows != total:
        raise LeRobotFormatError(f"{root}: data files hold {table.num_rows} frames, meta/episodes says {total}")
    ep_col = table.column("episode_index").to_numpy()
    for e in episodes:
        seg = ep_col[e.start:e.start + e.length]
        if len(seg) != e.length or (seg != e.index).any():
            raise LeRobotFormatError(f"{root}: frames of episode {e.index} are not where meta/episodes puts them")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise LeRobotFormatError(f"missing {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _decode(path: Path, timestamps: np.ndarray, tolerance: float) -> np.ndarray:
    """Frames of ``path`` at ``timestamps`` (seconds): seek near the first, decode to the last."""
    import av

    if not path.is_file():
        raise LeRobotFormatError(f"missing video {path}")
    if len(timestamps) == 0:
        return np.zeros((0, 0, 0, 3), np.uint8)
    lo, hi = float(timestamps.min()), float(timestamps.max())
    times, frames = [], []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        base = float(stream.time_base)
        if lo > 0:
            container.seek(int(max(0.0, lo - 1.0) / base), stream=stream, backward=True, any_frame=False)
        for frame in container.decode(stream):
            t = float(frame.pts) * base
            if t < lo - tolerance:
                continue
            if t > hi + tolerance:
                break
            times.append(t)
            frames.append(frame.to_ndarray(format="rgb24"))
    times_a = np.asarray(times)
    if not len(times_a):
        raise LeRobotFormatError(f"{path}: no frames between {lo:.3f} s and {hi:.3f} s")
    nearest = np.abs(times_a[None, :] - timestamps[:, None]).argmin(1)
    off = np.abs(times_a[nearest] - timestamps)
    if (off > tolerance).any():
        bad = float(timestamps[off.argmax()])
        raise LeRobotFormatError(f"{path}: no frame within {tolerance * 1e3:.0f} ms of t={bad:.3f} s")
    return np.stack([frames[i] for i in nearest])
