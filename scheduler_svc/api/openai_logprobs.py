"""The engine's logprobs (GenerateResponse's TokenLogprob entries, computed on the executor) as
the OpenAI API shapes them: chat's `logprobs.content[]`, the legacy completions' `tokens /
token_logprobs / top_logprobs / text_offset`, and vLLM's `prompt_logprobs`. Nothing is
recomputed here: only token ids become text.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pagedserve.scheduler.outputs import TokenLogprob


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """A token id's text (its own decode, as vLLM reports it) and its exact UTF-8 bytes (for a
    byte-level BPE vocabulary a token may be part of a character: its bytes are those, not
    the replacement character its decode shows)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._alphabet = _byte_level_alphabet() if "ByteLevel" in type(decoder).__name__ or \
            "ByteLevel" in repr(decoder) else None
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        if self._alphabet is not None:
            piece = self.tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._alphabet for c in piece):
                return [self._alphabet[c] for c in piece]
        return list(self.text(token_id).encode())


def chat_logprobs(tt: TokenText, token_ids: list[int], lps: list[TokenLogprob]) -> dict:
    """OpenAI chat's choices[i].logprobs: one entry per generated token."""
    def entry(t: int, lp: float) -> dict:
        return {"token": tt.text(t), "logprob": lp, "bytes": tt.bytes(t)}

    return {"content": [
        {**entry(t, lp.logprob), "top_logprobs": [entry(a, b) for a, b in zip(
            lp.top_ids, lp.top_logprobs, strict=True)]}
        for t, lp in zip(token_ids, lps, strict=True)], "refusal": None}


def completion_logprobs(tt: TokenText, token_ids: list[int],
                        lps: list[TokenLogprob] | list[TokenLogprob | None], offset: int,
                        k: int | None = None, into: dict | None = None) -> tuple[dict, int]:
    """The legacy completions' choices[i].logprobs for tokens whose text starts at character
    `offset` of the completion, and the offset after them. Each top_logprobs dict holds the k
    most likely tokens (all that were computed if k is None) and the sampled one (vLLM's: k + 1
    entries when it is not among them). An echoed prompt's tokens come first, the first of them
    unscored: its entry (None) is null in token_logprobs and top_logprobs, as OpenAI's is.
    into: a dict of these lists to extend (the echoed prompt's)."""
    out: dict[str, list] = into if into is not None else {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in zip(token_ids, lps, strict=True):
        text = tt.text(t)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(lp.logprob)
        top = {tt.text(a): b for a, b in zip(lp.top_ids[:k], lp.top_logprobs[:k], strict=True)}
        top.setdefault(text, lp.logprob)
        out["top_logprobs"].append(top)
    return out, offset


def prompt_logprobs(tt: TokenText, prompt: list[int], lps: list[TokenLogprob | None],
                    k: int | None = None) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then for each a dict of token
    id -> {logprob, rank, decoded_token}: the prompt token's and its k most likely
    alternatives' (ranks 1..k; all that were computed if k is None)."""
    out: list[dict | None] = []
    for t, lp in zip(prompt, lps, strict=True):
        if lp is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": tt.text(t)}}
        for r, (a, b) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k], strict=True), 1):
            d.setdefault(str(a), {"logprob": b, "rank": r, "decoded_token": tt.text(a)})
        out.append(d)
    return out
