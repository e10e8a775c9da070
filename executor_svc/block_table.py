"""The executor's mirror of block tables, kept in one persistent array.

Each request the executor holds owns a row; plans only append block ids to it. Building a
step's inputs then takes a few vectorised reads instead of per-token Python loops.
"""

from __future__ import annotations

import numpy as np


class BlockTableArray:
    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        self.array = np.zeros((rows, cols), dtype=np.int32)  # [row, block index] -> block id
        self.lengths = np.zeros(rows, dtype=np.int64)  # blocks in each row
        self._free_rows = list(range(rows - 1, -1, -1))

    def add(self, blocks: list[int]) -> int:
        if not self._free_rows:
            self._grow(rows=2 * self.array.shape[0])
        row = self._free_rows.pop()
        self.lengths[row] = 0
        self.append(row, blocks)
        return row

    def append(self, row: int, blocks: list[int]) -> None:
        n, k = int(self.lengths[row]), len(blocks)
        if n + k > self.array.shape[1]:
            self._grow(cols=max(2 * self.array.shape[1], n + k))
        self.array[row, n:n + k] = blocks
        self.lengths[row] = n + k

    def extend(self, rows: np.ndarray, counts: np.ndarray, blocks: np.ndarray) -> None:
        """Append counts[i] blocks to rows[i] (rows distinct), taken from blocks in order:
        a step's new blocks for all its requests in one scatter."""
        ends = self.lengths[rows] + counts
        if len(rows) and ends.max() > self.array.shape[1]:
            self._grow(cols=max(2 * self.array.shape[1], int(ends.max())))
        firsts = np.cumsum(counts) - counts  # each row's first index in blocks
        cols = np.repeat(self.lengths[rows] - firsts, counts) + np.arange(len(blocks))
        self.array[np.repeat(rows, counts), cols] = blocks
        self.lengths[rows] = ends

    def remove(self, row: int) -> None:
        self._free_rows.append(row)

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old_rows, old_cols = self.array.shape
        rows, cols = rows or old_rows, cols or old_cols
        array = np.zeros((rows, cols), dtype=np.int32)
        array[:old_rows, :old_cols] = self.array
        self.array = array
        self.lengths = np.concatenate([self.lengths, np.zeros(rows - old_rows, np.int64)])
        self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows


class RowColumns:
    """Each held request's scalar state, one numpy column per field, indexed by its block-table
    row: a decode step of B rows reads and updates them with a few fancy-indexing ops instead
    of B Python objects.

        req_id          -1 on a free row
        num_computed    tokens whose KV is in the cache
        known           tokens it has: prompt + generated, counting one still being sampled
        num_prompt      of those, the prompt's (min_tokens counts the rest)
        last_token      its token at known - 1, once read back (its decode step's input)
        pending_launch  the launch whose sampled token is its last one, unread; -1: none
        pending_index   that token's row in that launch's sampled tokens
        count_slot      its TokenCounts slot; -1: no penalty
        features        its SamplingSpec.features (which sampler stages it needs)
        spec            its SamplingSpec (object column)
        lora_slot       the device slot of its LoRA adapter; 0: the base model
    """

    INT_FIELDS = ("req_id", "num_computed", "known", "num_prompt", "last_token",
                  "pending_launch", "pending_index", "count_slot", "features", "lora_slot")
    FREE = {"req_id": -1, "pending_launch": -1, "count_slot": -1}

    def __init__(self, rows: int = 64) -> None:
        for name in self.INT_FIELDS:
            setattr(self, name, np.full(rows, self.FREE.get(name, 0), np.int64))
        self.spec = np.full(rows, None, object)

    def ensure(self, rows: int) -> None:
        """Grow to at least this many rows (the block table grew)."""
        old = len(self.req_id)
        if rows <= old:
            return
        for name in (*self.INT_FIELDS, "spec"):
            col = getattr(self, name)
            grown = np.full(rows, self.FREE.get(name, 0 if name != "spec" else None), col.dtype)
            grown[:old] = col
            setattr(self, name, grown)

    def clear(self, row: int) -> None:
        for name, value in self.FREE.items():
            getattr(self, name)[row] = value
        self.spec[row] = None
