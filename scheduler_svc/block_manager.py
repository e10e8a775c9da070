"""KV-cache block bookkeeping. The executor owns the tensors; this owns which block holds what.

Invariant (checked by `check_integrity`): every block id in [0, num_blocks) is either on the
free list or in exactly one request's block table. A request's table covers its first
len(table) * block_size token positions:

    table:   [ b7 ][ b2 ][ b9 ]            block_size = 4
    tokens:  0123  4567  89..              positions 10, 11 free for the next tokens
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, req_id: int) -> list[int]:
        return list(self._tables.get(req_id, ()))

    def allocate_slots(self, req_id: int, num_tokens: int, admit: bool = False) -> list[int] | None:
        """Grow req_id's table to hold num_tokens tokens; return the new block ids, or None if
        the pool cannot. A new admission (`admit`) must also leave the watermark free, so that
        running requests can still grow without being preempted at once."""
        table = self._tables.get(req_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return []
        reserve = self.watermark_blocks if admit else 0
        if need > len(self._free) - reserve:
            return None
        new = [self._free.popleft() for _ in range(need)]
        self._tables[req_id] = table + new
        return new

    def free(self, req_id: int) -> None:
        self._free.extend(self._tables.pop(req_id, ()))

    def check_integrity(self) -> None:
        owned = [b for table in self._tables.values() for b in table]
        if sorted([*self._free, *owned]) != list(range(self.num_blocks)):
            raise AssertionError(
                f"block accounting broken: {len(self._free)} free + {len(owned)} owned "
                f"!= {self.num_blocks}, or a block is listed twice"
            )
