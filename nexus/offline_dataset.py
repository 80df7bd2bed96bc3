"""Offline (SFT) datasets from the catalog: folders of Arrow IPC files in the trajectory layout.

A dataset is declared by a manifest ``datasets/<name>.toml`` (see ``datasets/README.md``); its rows
use :func:`nexus.trajectory_store.trajectory_schema`, so demonstrations recorded through the
Environment Service and RL trajectories share one format. Files are memory-mapped; batches are
sampled statelessly (a pure function of ``step`` and ``seed``) so an SFT producer can resume or
be restarted in place without replaying a random generator.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from nexus.catalog import CatalogError, DatasetEntry
from nexus.environment_service import episode_stats
from nexus.features import Observation, TenantSchema
from nexus.trajectory_store import (
    SUFFIX,
    arrays_to_observations,
    read_ipc,
    schema_from_arrow,
    table_arrays,
    trajectory_schema,
)

__all__ = ["DatasetMissingError", "OfflineDataset"]


class DatasetMissingError(FileNotFoundError):
    """A catalog dataset whose data files are not on disk (they are generated, not downloaded)."""


class OfflineDataset:
    """Rows of a catalog dataset with a deterministic, episode-level train / held-out split.

    ``successful_only`` (default) keeps only episodes that reached success at some step: recorders
    keep failed episodes in the files, flagged by their ``success`` column, for analysis; SFT
    should not imitate them. The last ``heldout_fraction`` of the kept episodes (by episode id,
    at least one when there are two or more) form the held-out split.
    """

    def __init__(self, entry: DatasetEntry, heldout_fraction: float = 0.1,
                 successful_only: bool = True) -> None:
        if entry.format != "arrow":
            raise CatalogError(f"dataset {entry.name!r}: unsupported format {entry.format!r} "
                               "(supported: arrow)")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError("heldout_fraction must be in [0, 1)")
        self.entry = entry
        files = sorted(entry.path.glob(f"*{SUFFIX}")) if entry.path.is_dir() else []
        if not files:
            how = f"`python {entry.generator}`" if entry.generator else "its generator"
            raise DatasetMissingError(f"dataset {entry.name!r}: no Arrow files in {entry.path}; "
                                      f"regenerate them with {how}")
        expected = trajectory_schema(entry.schema)
        tables = []
        for f in files:
            t = read_ipc(f)
            if not t.schema.equals(expected, check_metadata=False):
                raise ValueError(f"dataset {entry.name!r}: {f} does not match the manifest schema "
                                 f"{schema_from_arrow(t.schema) if t.schema.metadata else t.schema}")
            tables.append(t)
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="none")
        self._arrays = table_arrays(table.replace_schema_metadata(expected.metadata))
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
        """One :class:`Observation` per row of a batch (instruction from the manifest)."""
        return arrays_to_observations(arrays, self.schema)

    def _take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[rows] for k, v in self._arrays.items()}
