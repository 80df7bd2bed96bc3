"""LeRobot format: our writer (v2.1 and v3.0 layouts) read back by our reader, foreign datasets, SFT use."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nexus.config import catalog
from nexus.config.catalog import DatasetEntry
from nexus.data.lerobot_format import LeRobotDataset, LeRobotFormatError, camera_feature, write_lerobot
from nexus.data.offline_dataset import OfflineDataset
from nexus.features import CameraSpec, TenantSchema

SCHEMA = TenantSchema(proprio_dim=5, action_dim=3, cameras=(CameraSpec("front", 32, 48), CameraSpec("wrist", 16, 16)),
                      instruction="put the block in the bowl")
LENGTHS = [7, 12, 5]


def columns(schema: TenantSchema = SCHEMA, lengths: list[int] = LENGTHS) -> dict[str, np.ndarray]:
    """Episodes with smooth, camera-like frames (codecs are lossy; noise would be a worst case)."""
    rng = np.random.default_rng(0)
    n = sum(lengths)
    last = np.cumsum(lengths) - 1
    cols: dict[str, np.ndarray] = {
        "episode": np.repeat(np.arange(len(lengths)) + 10, lengths),
        "step": np.concatenate([np.arange(k) for k in lengths]).astype(np.int32),
        "state": rng.normal(size=(n, schema.proprio_dim)).astype(np.float32),
        "action": rng.uniform(-1, 1, (n, schema.action_dim)).astype(np.float32),
        "reward": rng.normal(size=n).astype(np.float32),
        "terminated": np.isin(np.arange(n), last[:2]), "truncated": np.isin(np.arange(n), last[2:]),
        "success": np.isin(np.arange(n), last[:2]),
    }
    for c in schema.cameras:
        yy, xx = np.mgrid[0:c.height, 0:c.width]
        cols[f"image.{c.name}"] = np.stack([np.stack([(xx * 4 + 3 * i) % 256, (yy * 5 + i) % 256,
                                                      np.full_like(xx, 40 + 5 * i)], -1) for i in range(n)]
                                           ).astype(np.uint8)
    return cols


@pytest.mark.parametrize("layout, codec", [("v2.1", "h264"), ("v3.0", "h264"), ("v3.0", "av1")])
def test_write_read_round_trip(tmp_path, layout, codec):
    cols = columns()
    write_lerobot(tmp_path / "ds", cols, SCHEMA, fps=20, layout=layout, codec=codec)
    ds = LeRobotDataset(tmp_path / "ds")
    assert ds.version == layout and ds.fps == 20 and ds.num_frames == sum(LENGTHS)
    assert [(e.index, e.length, e.tasks) for e in ds.episodes] == [
        (i, k, (SCHEMA.instruction,)) for i, k in enumerate(LENGTHS)]
    assert sorted(ds.video_keys) == [camera_feature("front"), camera_feature("wrist")]
    # numbers are stored exactly
    np.testing.assert_array_equal(ds.column("observation.state"), cols["state"])
    np.testing.assert_array_equal(ds.column("action"), cols["action"])
    np.testing.assert_array_equal(ds.column("next.reward"), cols["reward"])
    np.testing.assert_array_equal(ds.column("next.success"), cols["success"])
    np.testing.assert_array_equal(ds.column("next.done"), cols["terminated"] | cols["truncated"])
    np.testing.assert_array_equal(ds.column("frame_index"), cols["step"])
    # frames within codec tolerance (yuv420p, lossy): every frame, in order
    for e in ds.episodes:
        rows = np.arange(e.start, e.start + e.length)
        for c in SCHEMA.cameras:
            got = ds.frames(camera_feature(c.name), e.index).astype(np.int16)
            want = cols[f"image.{c.name}"][rows].astype(np.int16)
            assert got.shape == want.shape
            assert np.abs(got - want).mean() < 4.0, (e.index, c.name)
            # the right frame, not a neighbour: each frame is closer to its own original than to the next
            if e.length > 1:
                assert np.abs(got[:-1] - want[:-1]).mean() < np.abs(got[:-1] - want[1:]).mean()
    info = json.loads((tmp_path / "ds/meta/info.json").read_text())
    assert info["features"][camera_feature("front")]["shape"] == [32, 48, 3]
    assert info["total_episodes"] == 3 and info["codebase_version"] == layout
    with pytest.raises(FileExistsError):
        write_lerobot(tmp_path / "ds", cols, SCHEMA, fps=20, layout=layout)


def test_layout_files(tmp_path):
    cols = columns()
    write_lerobot(tmp_path / "a", cols, SCHEMA, fps=10, layout="v2.1")
    write_lerobot(tmp_path / "b", cols, SCHEMA, fps=10, layout="v3.0")
    a = {p.relative_to(tmp_path / "a").as_posix() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    b = {p.relative_to(tmp_path / "b").as_posix() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    assert {"meta/info.json", "meta/tasks.jsonl", "meta/episodes.jsonl", "meta/episodes_stats.jsonl",
            "data/chunk-000/episode_000002.parquet",
            "videos/chunk-000/observation.images.wrist/episode_000001.mp4"} <= a
    assert b == {"meta/info.json", "meta/tasks.parquet", "meta/stats.json", "meta/episodes/chunk-000/file-000.parquet",
                 "data/chunk-000/file-000.parquet", "videos/observation.images.front/chunk-000/file-000.mp4",
                 "videos/observation.images.wrist/chunk-000/file-000.mp4"}
    eps = pq.read_table(tmp_path / "b/meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [(r["dataset_from_index"], r["dataset_to_index"]) for r in eps] == [(0, 7), (7, 19), (19, 24)]
    assert eps[1]["videos/observation.images.front/from_timestamp"] == pytest.approx(0.7)
    stats = json.loads((tmp_path / "b/meta/stats.json").read_text())
    assert stats["action"]["mean"] == pytest.approx(cols["action"].mean(0).tolist(), abs=1e-6)
    assert stats["action"]["count"] == [24]


def _entry(path: Path, schema: TenantSchema = SCHEMA, features: dict | None = None) -> DatasetEntry:
    return DatasetEntry(name="lr", format="lerobot", path=path, env=None, schema=schema, features=features or {})


def test_offline_dataset_reads_our_lerobot_like_arrow(tmp_path):
    cols = columns()
    write_lerobot(tmp_path / "ds", cols, SCHEMA, fps=20, layout="v3.0")
    ds = OfflineDataset(_entry(tmp_path / "ds"), heldout_fraction=0.0, successful_only=False, image_cache_mb=1)
    rows = ds.train()
    np.testing.assert_array_equal(rows["state"], cols["state"])
    np.testing.assert_array_equal(rows["action"], cols["action"])
    np.testing.assert_array_equal(rows["terminated"], cols["terminated"])
    np.testing.assert_array_equal(rows["truncated"], cols["truncated"])
    assert np.abs(rows["image.front"].astype(int) - cols["image.front"]).mean() < 4
    assert ds.recorded_stats()["success_rate"] == pytest.approx(2 / 3)
    kept = OfflineDataset(_entry(tmp_path / "ds"), heldout_fraction=0.0)  # failed episode 2 dropped
    assert list(kept.train_episodes) == [0, 1]
    batch = kept.sample_batch(8, step=3, seed=0)
    obs = kept.observations(batch)
    assert obs[0].images["wrist"].shape == (16, 16, 3) and obs[0].instruction == SCHEMA.instruction


def _foreign_v20(root: Path) -> None:
    """A LeRobot v2.0 dataset as others publish them: PNG images inside the parquet, other key names,
    stats.json, no next.* features (e.g. LIBERO conversions: image / wrist_image / state / actions)."""
    from PIL import Image

    rng = np.random.default_rng(1)
    (root / "meta").mkdir(parents=True)
    lengths, start = [4, 6], 0
    for e, n in enumerate(lengths):
        imgs = []
        for i in range(n):
            buf = __import__("io").BytesIO()
            Image.fromarray(np.full((8, 8, 3), 10 * i + 100 * e, np.uint8)).save(buf, format="PNG")
            imgs.append({"bytes": buf.getvalue(), "path": None})
        table = pa.table({
            "image": pa.array(imgs, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            "state": pa.array(rng.normal(size=(n, 8)).astype(np.float32).tolist(), pa.list_(pa.float32())),
            "actions": pa.array(rng.normal(size=(n, 7)).astype(np.float32).tolist(), pa.list_(pa.float32())),
            "timestamp": pa.array(np.arange(n, dtype=np.float32) / 10), "frame_index": pa.array(np.arange(n)),
            "episode_index": pa.array(np.full(n, e)), "index": pa.array(np.arange(start, start + n)),
            "task_index": pa.array(np.full(n, e)),
        })
        (root / "data/chunk-000").mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / f"data/chunk-000/episode_{e:06d}.parquet")
        start += n
    features = {"image": {"dtype": "image", "shape": [8, 8, 3], "names": ["height", "width", "channel"]},
                "state": {"dtype": "float32", "shape": [8], "names": ["state"]},
                "actions": {"dtype": "float32", "shape": [7], "names": ["actions"]}}
    info = {"codebase_version": "v2.0", "fps": 10, "total_episodes": 2, "total_frames": start, "chunks_size": 1000,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": None, "features": features}
    (root / "meta/info.json").write_text(json.dumps(info))
    (root / "meta/tasks.jsonl").write_text('{"task_index": 0, "task": "open the drawer"}\n'
                                           '{"task_index": 1, "task": "close the drawer"}\n')
    (root / "meta/episodes.jsonl").write_text("".join(json.dumps({"episode_index": e, "tasks": [], "length": n}) + "\n"
                                                      for e, n in enumerate(lengths)))


def test_reader_accepts_a_foreign_lerobot_dataset_from_a_local_path(tmp_path):
    _foreign_v20(tmp_path / "libero_like")
    schema = TenantSchema(proprio_dim=8, action_dim=7, cameras=(CameraSpec("agentview", 8, 8),))
    entry = _entry(tmp_path / "libero_like", schema,
                   features={"state": "state", "action": "actions", "cameras": {"agentview": "image"}})
    ds = OfflineDataset(entry, heldout_fraction=0.0)
    assert ds.num_rows == 10 and list(ds.train_episodes) == [0, 1]  # no next.success: demonstrations
    rows = ds.train()
    assert rows["image.agentview"][5, 0, 0].tolist() == [110, 110, 110]  # PNG bytes decoded exactly
    assert rows["terminated"].sum() == 2 and not rows["truncated"].any()
    obs = ds.observations(rows)
    assert obs[0].instruction == "open the drawer" and obs[9].instruction == "close the drawer"

    wrong = _entry(tmp_path / "libero_like", TenantSchema(proprio_dim=9, action_dim=7), features={"action": "actions",
                                                                                                  "state": "state"})
    with pytest.raises(ValueError, match="state 8"):
        OfflineDataset(wrong)
    with pytest.raises(LeRobotFormatError, match="info.json"):
        LeRobotDataset(tmp_path)


@pytest.mark.parametrize("name", sorted(n for n, d in catalog.datasets().items() if d.format == "lerobot"))
def test_committed_lerobot_datasets_equal_their_arrow_twins(name):
    lr = OfflineDataset(catalog.dataset(name), heldout_fraction=0.0, successful_only=False)
    twin = OfflineDataset(catalog.dataset(name.removesuffix("-lerobot")), heldout_fraction=0.0,
                          successful_only=False)
    a, b = lr.train(), twin.train()
    for key in ("state", "action", "reward", "success", "terminated", "truncated", "step"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    for c in lr.schema.cameras:
        rows = np.arange(0, len(a["step"]), 7)  # a sample of frames: decoding all is slow-ish
        diff = np.abs(lr._take(rows)[f"image.{c.name}"].astype(int) - twin._take(rows)[f"image.{c.name}"]).mean()
        assert diff < 6.0, (c.name, diff)
    assert lr.recorded_stats() == twin.recorded_stats()
