"""One step's grammar host work as the engine does it (scheduler_svc/grammar.py): advance R
constrained rows' matchers by their sampled tokens (Grammars.accept, one batched call), then
fill their next masks (Grammars.fill), for a model whose logits are --logits wide beside the
default model's tokenizer (49,152 ids). The GPU benchmarks serve the 8B (128,256 logits) with
that tokenizer; an embedding padded past its tokenizer is the same case in miniature.

    python -m benchmarks.grammar_step [--rows 256] [--logits 49152 128256] [--steps 60]

The rows are matchers of benchmarks.structured's JSON schema, walked by random allowed tokens
(what random weights sample under the mask); medians per step, milliseconds, on this host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np


def measure(tokenizer, logits: int, rows: int, steps: int, seed: int = 0) -> dict:
    from benchmarks.structured import SCHEMA
    from pagedserve.scheduler.grammar import Grammars
    from pagedserve.scheduler.request import Constraint

    eos = tokenizer.eos_token_id
    g = Grammars(tokenizer, logits, [eos])
    try:
        compiled = asyncio.run(g.compile(Constraint("json_schema", json.dumps(SCHEMA))))
        matchers = [g.matcher(compiled) for _ in range(rows)]
        rng = np.random.default_rng(seed)
        mask = g.fill(matchers)
        accept, fill = [], []
        for _ in range(steps):
            tokens = []
            for row in mask:
                allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
                allowed = allowed[allowed != eos]
                tokens.append(int(rng.choice(allowed)) if len(allowed) else eos)
            t0 = time.perf_counter()
            ok = Grammars.accept(matchers, tokens)
            t1 = time.perf_counter()
            if not all(ok) or any(m.is_terminated() for m in matchers):
                break
            mask = g.fill(matchers)
            accept.append(t1 - t0)
            fill.append(time.perf_counter() - t1)
        return {"logits": logits, "rows": rows, "steps": len(accept),
                "accept_ms": 1e3 * statistics.median(accept),
                "fill_ms": 1e3 * statistics.median(fill), "fill_threads": g.fill_threads}
    finally:
        g.close()


def main() -> list[dict]:
    from transformers import AutoTokenizer

    from pagedserve.core.models import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--logits", type=int, nargs="+", default=[49152, 128256])
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    out = [measure(tokenizer, n, a.rows, a.steps) for n in a.logits]
    print("| logits | rows | accept ms | fill ms | fill threads |\n| --- | --- | --- | --- | --- |")
    for r in out:
        print(f"| {r['logits']:,} | {r['rows']} | {r['accept_ms']:.2f} | {r['fill_ms']:.2f} | "
              f"{r['fill_threads']} |")
    return out


if __name__ == "__main__":
    main()
