"""KV-cache block bookkeeping. The executor owns the tensors; this owns which block holds what.

Blocks are reference counted: with prefix caching, requests that share a prompt prefix share
the blocks holding it. A request's table covers its first len(table) * block_size positions:

    table:   [ b7 ][ b2 ][ b9 ]            block_size = 4
    tokens:  0123  4567  89..              positions 10, 11 free for the next tokens

A full block whose tokens are known is registered under a chained key (parent block's hash,
its own token ids), so the same prefix maps to the same blocks. Blocks with no reference sit on
the free list in LRU order (front = evicted first); a cached one stays findable there until it
is handed out again, which evicts it. A request's blocks are freed tail first, so its tail is
evicted before its prefix.

Invariants (checked by `check_integrity`): a block's ref count equals the number of tables
holding it; ref 0 <=> on the free list; the cache maps each key to the one block carrying it;
num_shared_refs is the sum over blocks of (ref - 1) where ref > 1. Only cached blocks are shared,
and a cached block is full and computed in every table holding it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockKey = tuple[int, tuple[int, ...]]  # (parent block's hash, this block's token ids)
_ROOT_HASH = 0


def prefix_root(lora_id: int) -> int:
    """The hash a request's chain of block keys starts from: the base model's, or one per
    LoRA adapter, so that the same tokens under two adapters (whose KV differs) share no block."""
    return _ROOT_HASH if not lora_id else hash(("lora", lora_id))


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The blocks holding a cached prompt prefix (opaque to the scheduler but for num_tokens)."""

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0,
                 enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockKey, int] = {}
        self._tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[int]] = {}  # req -> chained hash of each registered block
        self.num_shared_refs = 0  # references beyond a block's first: its tokens held once

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, req_id: int) -> list[int]:
        return list(self._tables.get(req_id, ()))

    def blocks_to_grow(self, req_id: int, num_tokens: int) -> int:
        """Blocks req_id's table must gain to hold num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(req_id, ())))

    def blocks_to_admit(self, num_tokens: int) -> int:
        """Free blocks a new request of num_tokens tokens needs to be admitted (watermark
        included)."""
        return self.blocks_for(num_tokens) + self.watermark_blocks

    def cached_prefix(self, token_ids: list[int], root: int = _ROOT_HASH) -> CachedPrefix:
        """The longest cached prefix of token_ids (its chain of keys from `root`, see
        prefix_root). At most len(token_ids) - 1 tokens are covered: the last prompt token is
        always computed, so that its logits exist."""
        if not self.enable_caching:
            return CachedPrefix()
        bs, parent, hit = self.block_size, root, []
        for i in range((len(token_ids) - 1) // bs):
            key = (parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            block = self._cached.get(key)
            if block is None:
                break
            hit.append(block)
            parent = hash(key)
        return CachedPrefix(tuple(hit), len(hit) * bs)

    # ------------------------------------------------------------------ changes
    def allocate_slots(self, req_id: int, num_tokens: int, admit: bool = False,
                       prefix: CachedPrefix | None = None) -> list[int] | None:
        """Grow req_id's table to hold num_tokens tokens, starting a new table with the cached
        `prefix` blocks if given. Return the newly allocated block ids, or None (and change
        nothing) if the pool cannot. A new admission (`admit`) must also leave the watermark
        free, so that running requests can still grow without being preempted at once."""
        table = self._tables.get(req_id)
        if table is not None and num_tokens <= len(table) * self.block_size:
            return []  # the common decode step: the last block still has room
        prefix = list(prefix.blocks) if table is None and prefix is not None else []
        have = len(table) if table is not None else len(prefix)
        need = self.blocks_for(num_tokens) - have
        revived = sum(1 for b in prefix if self._ref[b] == 0)  # leave the free list when shared
        reserve = self.watermark_blocks if admit else 0
        if max(need, 0) + revived > len(self._free) - reserve:
            return None
        for b in prefix:
            if self._ref[b] == 0:
                del self._free[b]
            else:
                self.num_shared_refs += 1
            self._ref[b] += 1
        new = [self._pop_free() for _ in range(max(need, 0))]
        self._tables[req_id] = (table or list(prefix)) + new
        if table is None:
            self._hashes[req_id] = [self._chain(req_id, i) for i in range(len(prefix))]
        return new

    def cache_full_blocks(self, req_id: int, token_ids: list[int], num_computed: int,
                          root: int = _ROOT_HASH) -> None:
        """Register req_id's blocks that are full and computed (num_computed tokens), their
        chain of keys from `root` (prefix_root)."""
        if not self.enable_caching:
            return
        table, hashes = self._tables[req_id], self._hashes[req_id]
        bs = self.block_size
        for i in range(len(hashes), num_computed // bs):
            parent = hashes[-1] if hashes else root
            key = (parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            block = table[i]
            if key not in self._cached and self._key[block] is None:
                self._cached[key] = block
                self._key[block] = key
            hashes.append(hash(key))  # identical content computed twice: keep both, share key

    def free(self, req_id: int) -> None:
        for b in reversed(self._tables.pop(req_id, ())):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
            else:
                self.num_shared_refs -= 1
        self._hashes.pop(req_id, None)

    def _pop_free(self) -> int:
        b, _ = self._free.popitem(last=False)
        key = self._key[b]
        if key is not None:  # evict: its content is about to be overwritten
            del self._cached[key]
            self._key[b] = None
        self._ref[b] = 1
        return b

    def _chain(self, req_id: int, i: int) -> int:
        key = self._key[self._tables[req_id][i]]
        assert key is not None, "a shared prefix block must be registered"
        return hash(key)

    def check_integrity(self) -> None:
        owners = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                owners[b] += 1
        problems = []
        if owners != self._ref:
            problems.append("ref counts differ from table membership")
        if self.num_shared_refs != sum(r - 1 for r in self._ref if r > 1):
            problems.append("num_shared_refs differs from the ref counts")
        if any((r == 0) != (b in self._free) for b, r in enumerate(self._ref)):
            problems.append("free list differs from unreferenced blocks")
        if any(self._key[b] != k for k, b in self._cached.items()) or \
                sum(k is not None for k in self._key) != len(self._cached):
            problems.append("cache map differs from block keys")
        if problems:
            raise AssertionError("block accounting broken: " + "; ".join(problems))


class HostBlockPool:
    """Host-memory blocks that hold the KV of requests preempted by swap (ids only; the
    executor owns the memory). Plain free list: a swapped block belongs to one request."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
