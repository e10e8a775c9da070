"""HF transformers logits processors for the sampling features HF lacks, written from the
public definitions (the oracles of the sampler and integration tests)."""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's formula over the generated tokens only:
    logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty."""

    def __init__(self, prompt_len: int, presence: float = 0.0, frequency: float = 0.0) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        out = input_ids[:, self.prompt_len:]
        ones = torch.ones_like(out, dtype=scores.dtype)
        counts = torch.zeros_like(scores).scatter_add_(1, out, ones)
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a fixed value added to the logits of some token ids."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        scores = scores.clone()
        for t, v in self.bias.items():
            scores[:, t] += v
        return scores


def processors(prompt_len: int, *, logit_bias: dict[int, float] | None = None,
               min_tokens: int = 0, masked_ids: tuple[int, ...] = (),
               repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0) -> LogitsProcessorList:
    """HF processors in the order pagedserve (and vLLM) applies them: logit_bias, min_tokens,
    repetition penalty, then presence/frequency penalties."""
    procs: list[LogitsProcessor] = []
    if logit_bias:
        procs.append(LogitBias(logit_bias))
    if min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, min_tokens, list(masked_ids)))
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if presence_penalty or frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, presence_penalty, frequency_penalty))
    return LogitsProcessorList(procs)
