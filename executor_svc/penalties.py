"""Per-request token counts on the device, for the rows that use a penalty.

    output[slot, v]  int32  times token v was generated so far
    prompt[slot, v]  bool   token v occurs in the prompt

A request that uses a penalty takes a slot when it arrives (first scheduled, or resumed after
a preemption: its counts are rebuilt from its token ids, so recompute gives the same output);
the counts of all the step's arrivals are loaded with one scatter each. After every sample the
batch's sampled tokens are added with one scatter on the device (no host round trip: the
tokens never leave the device for it). Requests without a penalty hold no slot and cost
nothing. Why incremental rather than rebuilt from the token ids each step: a rebuild moves
every penalized request's whole token list to the device every step (O(context) per row per
step); the increment moves nothing but the slot ids (docs/sampling.md has the measurements).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.executor.transfer import to_device


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.output = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.output.shape[0]

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def acquire(self) -> int:
        """A slot for a new request (its counts are set by load()); grows by doubling."""
        if not self._free:
            self._grow(max(4, 2 * self.capacity))
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def reset(self) -> None:
        self._free = list(range(self.capacity - 1, -1, -1))

    @torch.inference_mode(False)
    def _grow(self, capacity: int) -> None:
        # normal tensors even when grown inside inference mode (the GPU memory profile's):
        # record() and load() update them in place outside it, which an inference tensor refuses
        old = self.capacity
        out = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        out[:old], prompt[:old] = self.output, self.prompt
        self.output, self.prompt = out, prompt
        self._free.extend(range(capacity - 1, old - 1, -1))

    def load(self, arrivals: list[tuple[int, list[int], int]]) -> None:
        """Set the counts of newly arrived requests: (slot, token ids, number of prompt tokens)
        each; one transfer and two scatters for all of them."""
        if not arrivals:
            return
        slots = np.fromiter((s for s, _, _ in arrivals), np.int64, len(arrivals))
        lens = np.fromiter((len(t) for _, t, _ in arrivals), np.int64, len(arrivals))
        prompt_lens = np.fromiter((p for _, _, p in arrivals), np.int64, len(arrivals))
        ids = np.concatenate([np.asarray(t, np.int64) for _, t, _ in arrivals])
        offsets = np.repeat(np.cumsum(lens) - lens, lens)
        in_prompt = (np.arange(len(ids)) - offsets) < np.repeat(prompt_lens, lens)
        packed = np.stack([np.repeat(slots, lens), ids, in_prompt.astype(np.int64)])
        slot_t, ids_t, in_prompt_t = to_device(packed, self.device)
        rows = to_device(slots, self.device)
        self.output[rows] = 0
        self.prompt[rows] = False
        in_prompt_t = in_prompt_t.bool()
        self.prompt[slot_t[in_prompt_t], ids_t[in_prompt_t]] = True
        out = ~in_prompt_t
        self.output.index_put_((slot_t[out], ids_t[out]),
                               torch.ones_like(ids_t[out], dtype=torch.int32), accumulate=True)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled for the rows holding these slots (both [R], device)."""
        self.output.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32),
                               accumulate=True)

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, params: torch.Tensor,
              which: tuple[bool, bool, bool]) -> torch.Tensor:
        """Penalized logits of R rows: logits [R, V], slots [R], params [R, 3] = (repetition,
        frequency, presence); `which` says which of the three any row has (the others' full
        [R, V] passes are skipped)."""
        repetition, frequency, presence = which
        out = self.output[slots]  # [R, V]
        seen_out = out > 0 if repetition or presence else None
        if repetition:
            rep = params[:, 0:1]
            seen = seen_out | self.prompt[slots]
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        if frequency:
            logits = logits - params[:, 1:2] * out
        if presence:
            logits = logits - params[:, 2:3] * seen_out
        return logits
