"""Speculative decoding by a draft model (--speculative-config method draft_model): a smaller
model with the target's vocabulary, loaded beside it in this process, that proposes the drafts
the scheduler plans into the next step; the target then verifies them (ModelRunner._verify).

Its paged KV cache lives in the target's blocks: the same block ids and slots, in tensors of its
own (the worker sizes both into one budget, so a block costs the two models' bytes). Whatever
the target computes in a step, the draft computes too, over the same flat batch (mirror), so its
cache holds the same tokens at the same slots; prefix-cache hits, swaps and recomputes then need
nothing of their own (swaps copy both caches). After the step's tokens are read back, each
request that sampled gets up to k greedy drafts (propose): its sampled token at its next
position, then each draft after it, one single-token pass per draft, writing the draft's KV in
slots the request's blocks already hold. Those slots lie past its computed tokens, so the
target's next step writes over them.

On CUDA the draft has decode graphs of its own (`graphs`, captured after the target's): a
graphed step's mirror replays them, and so do the proposal passes, back to back, each pass's
argmax copied on the device into the next one's input (DecodeGraphs.greedy_chain): the host
launches one graph a pass and waits once, for the drafts of all of them.

The drafts are the draft model's argmax, one token with certainty each: verifying them by the
target's own sample is rejection sampling, and outputs follow the target's distribution
whatever the draft proposes. The draft's cache only decides how many are accepted.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.model import AttentionMetadata, CausalLM
from pagedserve.executor.transfer import to_device


def pass_grid(table: np.ndarray, rows: np.ndarray, starts: np.ndarray, ks: np.ndarray,
              block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The single-token passes of a proposal chain: row i runs ks[i] passes (at least one),
    pass j at position starts[i] + j. Positions, whether the row runs, and its slot (-1 when
    it sits the pass out), each [pass, row]; and the rows' block tables as wide as the
    passes reach."""
    bs, passes = block_size, int(ks.max())
    pos = starts[None, :] + np.arange(passes)[:, None]
    on = np.arange(passes)[:, None] < ks[None, :]  # the row still runs in this pass
    pos = np.where(on, pos, starts[None, :])  # (a row sitting out: a position it has)
    slots = np.where(on, table[rows[None, :], pos // bs].astype(np.int64) * bs + pos % bs, -1)
    width = int(pos.max()) // bs + 1
    return pos, on, slots, np.ascontiguousarray(table[rows, :width])


class DraftModelError(RuntimeError):
    """The draft cannot serve beside this target (its vocabulary differs, or the settings do
    not allow it): the same settings fail the same way, so the executor exits without a
    restart, as for MemoryBudgetError."""


class DraftModel:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.device = block_size, device
        self.proposed_tokens = 0  # drafts proposed since start (tests, logs)
        self.graphs: DecodeGraphs | None = None  # set by the worker (CUDA, not eager)

    def mirror(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The step's tokens through the draft, for its KV cache only."""
        self.model.hidden(ids, positions, self.kv_caches, meta)

    def mirror_graphed(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       tables: np.ndarray, seq_lens: np.ndarray,
                       patch: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """A decode-shaped step (one token a row, the target's graphed step) through the
        draft: by its graphs where they fit, else eagerly."""
        if self.graphs is not None and self.graphs.fits(len(input_ids), tables.shape[1]):
            self.graphs.run(input_ids, positions, slots, tables, seq_lens, patch)
            return
        dev = self.device
        ids = to_device(input_ids, dev)
        if patch is not None:
            ids[patch[0]] = patch[1]
        self.mirror(ids, to_device(positions, dev), AttentionMetadata(
            slot_mapping=to_device(slots, dev), block_tables=to_device(tables, dev),
            seq_lens=to_device(seq_lens.astype(np.int32), dev),
            cu_seqlens_q=to_device(np.arange(len(slots) + 1, dtype=np.int32), dev),
            max_query_len=1, max_seq_len=int(seq_lens.max())))

    @torch.inference_mode()
    def propose(self, table: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                tokens: np.ndarray, ks: np.ndarray) -> list[list[int]]:
        """Up to ks[i] greedy drafts after tokens[i], the token at position starts[i] of the
        request in block-table row rows[i]; ks[i] never reaches past its blocks (the caller
        caps it). The drafts of each row, in row order."""
        n, live = len(rows), np.flatnonzero(ks > 0)
        if not len(live):
            return [[] for _ in range(n)]
        rows, starts, tokens, ks = rows[live], starts[live], tokens[live], ks[live]
        pos, on, slots, tables = pass_grid(table, rows, starts, ks, self.block_size)
        if self.graphs is not None and self.graphs.fits(len(rows), tables.shape[1]):
            drafts = self.graphs.greedy_chain(tokens, pos, slots, tables,
                                              np.where(on, pos + 1, 0))
        else:
            drafts = self._eager_chain(tokens, pos, slots, tables, on)
        drafts = drafts.cpu().numpy()  # the one wait for the device
        out: list[list[int]] = [[] for _ in range(n)]
        for i, row, k in zip(range(len(live)), live.tolist(), ks.tolist(), strict=True):
            out[row] = drafts[:k, i].tolist()
        self.proposed_tokens += int(ks.sum())
        return out

    def _eager_chain(self, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray,
                     tables: np.ndarray, on: np.ndarray) -> torch.Tensor:
        """greedy_chain's passes run eagerly, each over the rows still drafting."""
        dev = self.device
        out = torch.zeros(pos.shape, dtype=torch.int64, device=dev)
        cur = to_device(tokens.astype(np.int64), dev)
        for j in range(len(pos)):
            live = np.flatnonzero(on[j])
            n = len(live)
            meta = AttentionMetadata(
                slot_mapping=to_device(slots[j, live], dev),
                block_tables=to_device(np.ascontiguousarray(tables[live]), dev),
                seq_lens=to_device((pos[j, live] + 1).astype(np.int32), dev),
                cu_seqlens_q=to_device(np.arange(n + 1, dtype=np.int32), dev),
                max_query_len=1, max_seq_len=int(pos[j, live].max()) + 1)
            index = to_device(live, dev)
            logits = self.model(cur[index], to_device(pos[j, live], dev), self.kv_caches, meta,
                                torch.arange(n, device=dev))
            out[j, index] = logits.argmax(dim=-1)
            cur = out[j].clone()
        return out
