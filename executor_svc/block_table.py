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
