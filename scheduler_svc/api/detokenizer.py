"""Incremental detokenization and stop-string handling, per request.

Text is released only when it is final: a token that ends inside a multi-byte UTF-8 character
decodes to U+FFFD and is held until the next token completes it, and the tail of the text that
could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REPLACEMENT = "\ufffd"


def decoder_of(tokenizer: Any) -> Callable[..., str]:
    """`tokenizer.decode`, or the Rust `tokenizers.Tokenizer.decode` under it where the result
    is the same: transformers' wrapper first converts the ids element by element (to_py_obj),
    which with 256 running requests cost more than half of the scheduler's time per step. The
    wrapper adds nothing but its clean-up pass, which it skips for BPE models (or which the
    tokenizer turns off)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or not hasattr(backend, "model"):
        return tokenizer.decode
    cleans = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    if cleans and (type(backend.model).__name__ != "BPE" or getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            False)):
        return tokenizer.decode
    return backend.decode


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    It decodes a small window (from `prefix_offset`) twice, with and without the new tokens,
    and returns the difference, so that tokenizers whose decoding depends on the previous token
    (leading-space handling, byte fallback) produce exactly what a full decode would.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 decode: Callable[..., str] | None = None) -> None:
        self.tok = tokenizer
        self.decode = decode or decoder_of(tokenizer)
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._delta(final=False)

    def push_many(self, token_ids: list[int]) -> str:
        """The text several new tokens complete, for the cost of one."""
        self.ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the very end becomes U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        decode = self.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset],
                        skip_special_tokens=self.skip)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]


class StopStringMatcher:
    """Accumulates released text, finds stop strings, and holds back a possible partial match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str | None]:
        """Add text; return (text to send now, matched stop string or None)."""
        if not self.stops:  # nothing to match or hold back: no need to keep the text
            return delta, None
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            idx, stop = min(hits)
            out = self.text[self.sent:idx]
            self.sent = idx
            return out, stop
        end = len(self.text) if final else len(self.text) - self._partial_match()
        out = self.text[self.sent:end]
        self.sent = end
        return out, None

    def _partial_match(self) -> int:
        """Length of the longest unsent suffix that is the start of some stop string."""
        for k in range(min(self.hold, len(self.text) - self.sent), 0, -1):
            suffix = self.text[-k:]
            if any(s.startswith(suffix) for s in self.stops):
                return k
        return 0
