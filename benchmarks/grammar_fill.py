"""Host time to fill one step's token bitmasks: R constrained rows, serially (one
GrammarMatcher.fill_next_token_bitmask per row, what the scheduler did first) against one
batched call (xgrammar.BatchGrammarMatcher, its threads), what scheduler_svc/grammar.py does.

The rows are matchers of benchmarks.structured's JSON schema, each walked a random number of
random allowed tokens (what random weights sample under the mask: long strings of odd tokens),
on the default model's vocabulary and on benchmarks.grammar_engines' synthetic 128,256-token one.

    python -m benchmarks.grammar_fill [--rows 64 256] [--threads 0 2 8]   # markdown table
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np


def walked_matchers(compiled, vocab: int, eos: int, rows: int, seed: int = 0) -> list:
    """rows matchers, each after 0-160 random allowed tokens (never ended)."""
    import torch
    import xgrammar as xgr

    rng = random.Random(seed)
    mask = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
    out = []
    while len(out) < rows:
        m = xgr.GrammarMatcher(compiled)
        for _ in range(rng.randint(0, 160)):
            m.fill_next_token_bitmask(mask, 0)
            bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab]
            allowed = [t for t in np.flatnonzero(bits).tolist() if t != eos]
            if not allowed:
                break
            assert m.accept_token(rng.choice(allowed))
        out.append(m)
    return out


def time_fill(fill, reps: int) -> float:
    """Median seconds of fill()."""
    fill()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from benchmarks.grammar_engines import big_tokenizer
    from benchmarks.structured import SCHEMA
    from pagedserve.core.models import resolve_model

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--threads", type=int, nargs="+", default=[2, 8])
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    base = AutoTokenizer.from_pretrained(str(resolve_model("default")))
    print("| vocabulary | rows | serial (ms) | " +
          " | ".join(f"batched, {t} threads (ms)" for t in args.threads) + " |")
    print("|---|---|---|" + "---|" * len(args.threads))
    for label, tok in (("SmolLM2 49,152", base), ("synthetic 128,256", big_tokenizer(base))):
        vocab = len(tok)
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab,
                                                  stop_token_ids=[tok.eos_token_id])
        compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False
                                       ).compile_json_schema(json.dumps(SCHEMA),
                                                             strict_mode=True,
                                                             any_whitespace=False)
        for rows in args.rows:
            ms = walked_matchers(compiled, vocab, tok.eos_token_id, rows)
            mask = torch.empty((rows, (vocab + 31) // 32), dtype=torch.int32)

            def serial(ms=ms, mask=mask):
                for i, m in enumerate(ms):
                    m.fill_next_token_bitmask(mask, i)

            cells = [time_fill(serial, args.reps)]
            for threads in args.threads:
                batch = xgr.BatchGrammarMatcher(threads)
                cells.append(time_fill(
                    lambda b=batch, ms=ms, mask=mask: b.batch_fill_next_token_bitmask(ms, mask),
                    args.reps))
            print(f"| {label} | {rows} | " + " | ".join(f"{c * 1e3:.2f}" for c in cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
