"""Decode paged attention over an FP8 (e4m3) KV cache beside a bf16 one, in the same run.

    python3 benchmarks/kernels/bench_fp8_kv.py              # GPU: batch 64 x 8k, 8B shapes
    python3 benchmarks/kernels/bench_fp8_kv.py --smoke      # CPU interpreter, tiny sizes
    python3 benchmarks/kernels/bench_fp8_kv.py --sweep      # FP8 decode configs (kind
                                                            # decode_fp8kv_sweep)

Llama-3.1-8B attention shapes (32 q heads, 8 KV heads, head dim 128, 16-token blocks); both
caches hold the same random values (the FP8 one quantized with scales 0.5/0.25, so the scale
folding runs). Timings are CUDA-graph replays (median), bf16 and FP8 alternated ROUNDS times.
Records (family `kernels`, kind `decode_fp8kv`): ms, TB/s of the cache bytes read, the speed-up
of FP8 over bf16, and the FP8 output's relative error against the bf16 one (and against the
reference on the FP8 cache: the kernel's own error).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.timing import interpret  # noqa: E402

H, HKV, D, BS = 32, 8, 128, 16
K_SCALE, V_SCALE = 0.5, 0.25


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sweep", action="store_true",
                   help="time the decode launch over tile/warp/stage configs on an FP8 cache "
                        "beside bf16's, at 64 x 8k and 256 x 2k")
    return p.parse_args()


ARGS = parse()
if ARGS.smoke:
    interpret()

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.common import write_records  # noqa: E402
from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.paged_attention import Config, launch, paged_attention  # noqa: E402

SWEEP = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2)]


@dataclass
class Batch:
    """b decode rows of context ctx over scattered blocks; the same random K/V as a cache of
    dt and as an FP8 one (scales K_SCALE, V_SCALE)."""

    b: int
    ctx: int
    k: torch.Tensor
    v: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor
    cu: torch.Tensor
    q: torch.Tensor
    scale: float = D**-0.5

    @classmethod
    def make(cls, b: int, ctx: int, dev: torch.device, dt: torch.dtype) -> Batch:
        torch.manual_seed(0)
        nblk = -(-ctx // BS)
        shape = (b * nblk, BS, HKV, D)
        k = torch.randn(shape, device=dev, dtype=dt)
        v = torch.randn(shape, device=dev, dtype=dt)
        return cls(b, ctx, k, v, reference.quantize_fp8(k, K_SCALE),
                   reference.quantize_fp8(v, V_SCALE),
                   torch.randperm(b * nblk, device=dev).int().view(b, nblk),
                   torch.full((b,), ctx, dtype=torch.int32, device=dev),
                   torch.arange(b + 1, dtype=torch.int32, device=dev),
                   torch.randn(b, H, D, device=dev, dtype=dt))

    def reference8(self) -> torch.Tensor:
        """Attention over the FP8 cache by the fp32 reference."""
        return reference.paged_attention(self.q.float(), self.k8, self.v8, self.tables,
                                         self.seq_lens, self.cu, self.scale,
                                         k_scale=K_SCALE, v_scale=V_SCALE)


def sweep() -> None:
    """Decode configs for an FP8 cache (its tiles widened to fp16 in the kernel), each checked
    against the reference, beside bf16's."""
    records = []
    for b, ctx in ((64, 8192), (256, 2048)):
        x = Batch.make(b, ctx, torch.device("cuda"), torch.bfloat16)
        ref8 = x.reference8()
        cases = [("bfloat16", c) for c in SWEEP[:3]] + [("float8_e4m3fn", c) for c in SWEEP]
        for kv, (tile_n, warps, stages) in cases:
            fp8 = kv == "float8_e4m3fn"
            kc, vc, ks, vs = (x.k8, x.v8, K_SCALE, V_SCALE) if fp8 else (x.k, x.v, 1.0, 1.0)
            out = torch.empty_like(x.q)
            cfg = Config(16, tile_n, warps, stages)
            fn = functools.partial(launch, x.q, kc, vc, x.tables, x.seq_lens, x.cu, x.scale, out,
                                   cfg, per_seq=True, num_splits=1, k_scale=ks, v_scale=vs)
            try:
                ms = bench(fn)
            except Exception as e:  # a config the compiler refuses (shared memory)
                print(f"B={b} ctx={ctx} {kv} {cfg}: {type(e).__name__}")
                continue
            err = rel_err(out, ref8) if fp8 else None
            nbytes = 2 * kc.numel() * kc.element_size()
            records.append({"kind": "decode_fp8kv_sweep", "impl": "pagedserve",
                            "kv_cache_dtype": kv, "widen_to": "float16" if fp8 else "bfloat16",
                            "batch": b, "ctx": ctx, "tile_n": tile_n, "num_warps": warps,
                            "num_stages": stages, "ms": ms, "tbps": nbytes / ms / 1e9,
                            "rel_err_vs_reference": err})
            print(f"B={b:3d} ctx={ctx:5d} {kv:14s} tile {tile_n:3d} warps {warps} stages "
                  f"{stages}: {ms:.4f} ms {nbytes / ms / 1e9:5.2f} TB/s"
                  + (f" err {err:.1e}" if err is not None else ""), flush=True)
    print("wrote", write_records("kernels", records))


def bench(fn) -> float:
    if ARGS.smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    dev = torch.device("cpu" if ARGS.smoke else "cuda")
    dt = torch.float32 if ARGS.smoke else torch.bfloat16
    b, ctx = (2, 64) if ARGS.smoke else (ARGS.batch, ARGS.ctx)
    x = Batch.make(b, ctx, dev, dt)
    base = str(dt).removeprefix("torch.")  # bfloat16 (float32 in the smoke run)
    outs = {base: torch.empty_like(x.q), "float8_e4m3fn": torch.empty_like(x.q)}
    caches = {base: (x.k, x.v, 1.0, 1.0), "float8_e4m3fn": (x.k8, x.v8, K_SCALE, V_SCALE)}

    def call(name):
        kc, vc, ks, vs = caches[name]
        return lambda: paged_attention(x.q, kc, vc, x.tables, x.seq_lens, x.cu, x.scale,
                                       max_query_len=1, max_seq_len=ctx, out=outs[name],
                                       k_scale=ks, v_scale=vs)

    fns = {name: call(name) for name in caches}
    for fn in fns.values():
        fn()
    ref8 = x.reference8()
    errs = {"rel_err_vs_bf16": rel_err(outs["float8_e4m3fn"], outs[base]),
            "rel_err_vs_reference": rel_err(outs["float8_e4m3fn"], ref8)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ARGS.rounds):  # alternated: clocks and neighbours hit both alike
        for name, fn in fns.items():
            times[name].append(bench(fn))
    ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    records = []
    for name, (kc, _, _, _) in caches.items():
        nbytes = 2 * kc.numel() * kc.element_size()
        records.append({
            "kind": "decode_fp8kv", "impl": "pagedserve", "kv_cache_dtype": name,
            "dtype": str(dt).removeprefix("torch."), "batch": b, "ctx": ctx, "heads": H,
            "kv_heads": HKV, "head_dim": D, "block_size": BS, "ms": ms[name],
            "ms_rounds": times[name], "tbps": nbytes / ms[name] / 1e9,
            "speedup_vs_bf16": ms[base] / ms[name], **errs,
            "smoke": ARGS.smoke})
        print(f"decode B={b} ctx={ctx} kv {name:14s} {ms[name]:8.4f} ms "
              f"{nbytes / ms[name] / 1e9:6.2f} TB/s  x{ms[base] / ms[name]:.2f}",
              flush=True)
    print(f"fp8 vs bf16 output rel err {errs['rel_err_vs_bf16']:.4f}, vs reference "
          f"{errs['rel_err_vs_reference']:.2e}")
    if errs["rel_err_vs_reference"] > 1e-2:
        raise SystemExit("FP8 decode output disagrees with the reference")
    print("wrote", write_records("kernels", records))


if __name__ == "__main__":
    sweep() if ARGS.sweep else main()
