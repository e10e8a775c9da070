"""Mask-fill time per token of the two grammar engines on PyPI (xgrammar, llguidance), on the
default model's tokenizer (SmolLM2, 49,152 tokens) and on a 128,256-token vocabulary.

No 128k tokenizer can be fetched here, so the large one is synthetic: SmolLM2's byte-level BPE
vocabulary plus concatenations of two of its tokens up to 128,256 entries (Llama 3's size), with
no merges (the engines read only the token strings). Each run walks a JSON schema's valid
document token by token, timing the fill of the next-token bitmask at every step (one thread).

    python -m benchmarks.grammar_engines   # prints a markdown table (docs/structured_outputs.md)
"""

from __future__ import annotations

import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "address", "role"],
}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
                  "address": {"city": "London", "zip": "W1"}, "role": "admin"})


def big_tokenizer(base):
    """A fast HF tokenizer with 128,256 byte-level tokens (see the module doc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(base.get_vocab())
    words = sorted(vocab, key=vocab.get)[:4000]
    extra = (a + b for a in words for b in words)
    for tok in extra:
        if len(vocab) >= 128256:
            break
        vocab.setdefault(tok, len(vocab))
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token=base.eos_token)


def _stats(times: list[float]) -> tuple[float, float]:
    us = sorted(t * 1e6 for t in times)
    return statistics.mean(us), us[int(0.99 * (len(us) - 1))]


def bench_xgrammar(tok, ids: list[int], reps: int) -> tuple[float, float, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False
                                   ).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for _ in range(reps):
        m = xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.accept_token(t), t
    return (compile_s * 1e3, *_stats(times))


def bench_llguidance(tok, ids: list[int], reps: int) -> tuple[float, float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    mask = llguidance.torch.allocate_token_bitmask(1, len(tok))
    times = []
    for _ in range(reps):
        m = llguidance.LLMatcher(lltok, grammar)
        for t in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.consume_token(t), (t, m.get_error())
    return (compile_s * 1e3, *_stats(times))


def main() -> None:
    from transformers import AutoTokenizer

    from pagedserve.core.models import resolve_model

    base = AutoTokenizer.from_pretrained(str(resolve_model("default")))
    print("| engine | vocabulary | compile (ms) | fill mean (µs/token) | fill p99 (µs/token) |")
    print("|---|---|---|---|---|")
    for label, tok in (("SmolLM2 49,152", base), ("synthetic 128,256", big_tokenizer(base))):
        ids = tok.encode(DOC, add_special_tokens=False)
        for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            fn(tok, ids, 1)  # warm-up (first-use caches)
            c, mean, p99 = fn(tok, ids, 5)
            print(f"| {name} | {label} | {c:.1f} | {mean:.1f} | {p99:.1f} |", flush=True)


if __name__ == "__main__":
    main()
