"""Check and time the Triton kernels against torch on one GPU, in one call.

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels/bench_kernels.py --out $OUT | tee $OUT/log

1. runs tests/kernels (CUDA cases: bf16/fp16 at model sizes);
2. re-measures the two ceilings (device copy TB/s, bf16 GEMM TFLOP/s);
3. decode paged attention vs torch SDPA on contiguous K/V (Llama-3.1-8B: 32 q heads, 8 KV
   heads, D=128, block 16), prefill vs SDPA causal, prefill over an FP8 cache (each long-row
   kernel), config sweeps (decode, and the long prefill rows), fused ops vs torch;
4. writes one JSON record per measurement to <out>/kernels_<date>.jsonl (BENCHMARKS.md).

Timings are CUDA-graph replays (triton.testing.do_bench_cudagraph, median) so that host launch
cost, which the executor's graphs also remove, does not hide small kernels. Inputs are fresh
random data; small cases rotate over enough copies to exceed the 60 MB L2.
`--dry` runs tiny sizes on CPU under the Triton interpreter to check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.kernels.timing import interpret  # noqa: E402

H, HKV, D, BS = 32, 8, 128, 16
L2_BYTES = 240 << 20  # rotate inputs until the working set is 4x the H200's 60 MB L2


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--dry", action="store_true")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--sections", default="",
                   help="comma-separated sections to run (default: all): prefill,...")
    return p.parse_args()


ARGS = parse()
if ARGS.dry:
    interpret()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

import pagedserve.kernels.paged_attention as pa  # noqa: E402
import pagedserve.kernels.paged_prefill_hopper as hopper  # noqa: E402
from pagedserve.kernels import fused, kv_cache, reference  # noqa: E402

DEV = torch.device("cpu" if ARGS.dry else "cuda")
DT = torch.float32 if ARGS.dry else torch.bfloat16
SDPA = torch.nn.functional.scaled_dot_product_attention
RECORDS: list[dict] = []
ROWS: list[str] = []


def meta() -> dict:
    commit = os.environ.get("PAGEDSERVE_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True)
            commit = commit.strip()
        except Exception:
            commit = "unknown"
    return {
        "commit": commit,
        "gpu": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu-interpreter",
        "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


META = meta()


def record(**kw) -> None:
    rec = {**META, **kw}
    RECORDS.append(rec)
    print(json.dumps(rec), flush=True)


def bench(fn) -> float:
    """Median ms of CUDA-graph replays (falls back to event timing if capture fails)."""
    if ARGS.dry:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
    except Exception as exc:  # noqa: BLE001
        print(f"graph capture failed ({exc!r}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def rotating(sets: list):
    it = itertools.cycle(sets)
    return lambda: next(it)


def section(fn):
    """Run one benchmark section; a failure is logged and the rest still runs."""
    def run(*a, **kw):
        if ARGS.sections and fn.__name__ not in ARGS.sections.split(","):
            return
        print(f"\n=== {fn.__name__}", flush=True)
        t = time.time()
        try:
            fn(*a, **kw)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            ROWS.append(f"{fn.__name__}: FAILED (see log)")
        print(f"=== {fn.__name__} done in {time.time() - t:.1f}s", flush=True)
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return run


@section
def run_tests() -> None:
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-rs"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    print(res.stdout[-6000:], res.stderr[-3000:], flush=True)
    (Path(ARGS.out) / "pytest.log").write_text(res.stdout + res.stderr)
    ROWS.append(f"pytest tests/kernels: rc={res.returncode} {res.stdout.strip().splitlines()[-1]}")


@section
def ceilings() -> None:
    n = (64 << 20) if ARGS.dry else (2 << 30)
    src = torch.randn(n // 2, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    tbps = 2 * n / ms / 1e9
    m = 512 if ARGS.dry else 8192
    a = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    ms_mm = bench(lambda: a @ b)
    tflops = 2 * m**3 / ms_mm / 1e9
    record(kind="ceiling_copy", impl="torch", ms=ms, tbps=tbps, bytes=2 * n)
    record(kind="ceiling_gemm_bf16", impl="torch", ms=ms_mm, tflops=tflops, m=m, n=m, k=m)
    ROWS.append(f"ceilings: copy {tbps:.2f} TB/s, bf16 gemm {tflops:.0f} TFLOP/s")


def paged_case(q_lens: list[int], ctxs: list[int], copies: int = 1):
    """One cache holding `copies` independent block sets; returns cache and per-copy args."""
    need = [triton.cdiv(c, BS) for c in ctxs]
    per = sum(need)
    shape = (per * copies, BS, HKV, D)
    k_cache = torch.randn(shape, device=DEV, dtype=DT)
    v_cache = torch.randn(shape, device=DEV, dtype=DT)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
    perm = torch.randperm(per * copies, device=DEV).int()
    sets = []
    for c in range(copies):
        bt = torch.zeros(len(ctxs), max(need), dtype=torch.int32, device=DEV)
        ids = perm[c * per:(c + 1) * per]
        off = 0
        for b, n in enumerate(need):
            bt[b, :n] = ids[off:off + n]
            off += n
        q = torch.randn(int(cu[-1]), H, D, device=DEV, dtype=DT)
        sets.append((q, bt))
    return k_cache, v_cache, cu, seq_lens, sets


@section
def decode() -> None:
    batches = [1, 8] if ARGS.dry else [1, 8, 64, 256]
    ctxs = [64, 200] if ARGS.dry else [512, 2048, 8192, 32768]
    scale = D**-0.5
    for b, ctx in itertools.product(batches, ctxs):
        if b * ctx > (1 << 22):
            continue
        kv_bytes = 2 * b * ctx * HKV * D * 2
        copies = 1 if ARGS.dry else max(1, min(64, L2_BYTES // kv_bytes))
        k_cache, v_cache, cu, sl, sets = paged_case([1] * b, [ctx] * b, copies)
        outs = [torch.empty(b, H, D, device=DEV, dtype=DT) for _ in sets]
        nxt = rotating(list(zip(sets, outs, strict=True)))

        def ours(nxt=nxt, k_cache=k_cache, v_cache=v_cache, cu=cu, sl=sl, ctx=ctx):
            (q, bt), out = nxt()
            pa.paged_attention(q, k_cache, v_cache, bt, sl, cu, scale, max_query_len=1,
                               max_seq_len=ctx, out=out)

        # Peer: SDPA on contiguous K/V gathered from the same cache; the 4 query heads of a
        # KV group become 4 query rows (exact for decode, and the fastest way to call it).
        ks, vs, qs = [], [], []
        for q, bt in sets:
            ks.append(k_cache[bt.long()].reshape(b, -1, HKV, D)[:, :ctx].transpose(1, 2)
                      .contiguous())
            vs.append(v_cache[bt.long()].reshape(b, -1, HKV, D)[:, :ctx].transpose(1, 2)
                      .contiguous())
            qs.append(q.view(b, HKV, H // HKV, D))
        nxt_t = rotating(list(zip(qs, ks, vs, strict=True)))

        def peer(nxt_t=nxt_t):
            q, k, v = nxt_t()
            return SDPA(q, k, v, scale=scale)

        (q0, _), out0 = sets[0], outs[0]
        ours()  # rotation is at copy 1 next; recompute copy 0 for the check
        pa.paged_attention(q0, k_cache, v_cache, sets[0][1], sl, cu, scale, out=out0)
        err = (out0.float() - SDPA(qs[0], ks[0], vs[0], scale=scale).reshape(b, H, D).float())
        err = (err.norm() / out0.float().norm()).item()
        nbytes = kv_bytes + 2 * b * H * D * 2
        for impl, fn in (("pagedserve", ours), ("torch_sdpa", peer)):
            ms = bench(fn)
            record(kind="decode", impl=impl, batch=b, ctx=ctx, ms=ms, tbps=nbytes / ms / 1e9,
                   dtype=str(DT), block_size=BS, copies=copies, rel_err_vs_sdpa=err)
            ROWS.append(f"decode  {impl:10s} B={b:<4d} ctx={ctx:<6d} {ms:8.4f} ms "
                        f"{nbytes / ms / 1e9:6.2f} TB/s")
        del k_cache, v_cache, ks, vs, sets, outs


@section
def prefill() -> None:
    # the long shapes of issue 32 (1 x 8k, 4 x 4k, 1 x 32k, 1 x 128k) and 16 x 1k, then a
    # 2,048- and a 512-token chunk (the default --long-prefill-token-threshold) at the end of
    # a 128k prompt (no SDPA peer: its causal mask is not the top-left one SDPA's flash path
    # takes)
    cases = [(1, 128, 128), (1, 32, 128)] if ARGS.dry else [
        (1, 8192, 8192), (4, 4096, 4096), (16, 1024, 1024), (1, 32768, 32768),
        (1, 131072, 131072), (1, 2048, 131072), (1, 512, 131072)]
    scale = D**-0.5
    for b, q_len, seq in cases:
        k_cache, v_cache, cu, sl, sets = paged_case([q_len] * b, [seq] * b)
        q, bt = sets[0]
        # causal: QK^T and PV over the lower triangle of the last q_len rows
        flops = 4 * b * H * D * q_len * (seq - q_len + (q_len + 1) / 2)

        def ours(kernel: str | None, out: torch.Tensor, q=q, bt=bt, k_cache=k_cache,
                 v_cache=v_cache, cu=cu, sl=sl, q_len=q_len, seq=seq):
            # kernel None: as served (the Hopper kernel from hopper.MIN_KEYS keys on sm_90);
            # "hopper" / "portable": that long-row kernel, forced; key splits as served
            env = {} if kernel is None else {hopper.ENV: kernel}
            with mock.patch.dict(os.environ, env):
                pa.paged_attention(q, k_cache, v_cache, bt, sl, cu, scale, max_query_len=q_len,
                                   max_seq_len=seq, out=out)

        # (name, timed call, its output: None for the peer)
        kernels = [None, "portable", "hopper"] if hopper.available(q, k_cache) else [None]
        impls = []
        for kernel in kernels:
            out = torch.empty_like(q)
            impls.append(("pagedserve" + (f"_{kernel}" if kernel else ""),
                          functools.partial(ours, kernel, out), out))
        ref = None
        if q_len == seq:
            k = k_cache[bt.long()].reshape(b, -1, HKV, D)[:, :seq].transpose(1, 2)
            v = v_cache[bt.long()].reshape(b, -1, HKV, D)[:, :seq].transpose(1, 2)
            # Peer gets K/V pre-expanded to 32 heads so it runs the flash kernel.
            k = k.repeat_interleave(H // HKV, dim=1).contiguous()
            v = v.repeat_interleave(H // HKV, dim=1).contiguous()
            qt = q.view(b, seq, H, D).transpose(1, 2).contiguous()

            def peer(qt=qt, k=k, v=v):
                return SDPA(qt, k, v, is_causal=True, scale=scale)

            impls.append(("torch_sdpa", peer, None))
            ref = peer().transpose(1, 2).reshape(b * seq, H, D).float()
            del k, v
        base = None  # the as-served output: the forced kernels are checked against it
        for impl, fn, got in impls:
            fn()
            if base is None:
                base = got.float()
            against = ref if ref is not None else base
            err = ((got.float() - against).norm() / against.norm()).item() \
                if got is not None else 0.0
            ms = bench(fn)
            record(kind="prefill", impl=impl, batch=b, ctx=seq, q_len=q_len, ms=ms,
                   tflops=flops / ms / 1e9, dtype=str(DT), block_size=BS,
                   **{"rel_err_vs_sdpa" if ref is not None else "rel_err_vs_served": err})
            ROWS.append(f"prefill {impl:10s} B={b:<4d} L={q_len:<6d} ctx={seq:<6d} {ms:8.4f} ms "
                        f"{flops / ms / 1e9:6.1f} TFLOP/s")
        del k_cache, v_cache


@section
def prefill_fp8() -> None:
    """Prefill over an FP8 (e4m3) cache: as served, and each long-row kernel forced (the
    Hopper kernel widens its tiles to fp16 in shared memory, the portable one in registers),
    beside the same shapes over the bf16 cache as served (prefill's records)."""
    from pagedserve.kernels.reference import quantize_fp8

    cases = [(1, 128, 128)] if ARGS.dry else [
        (1, 8192, 8192), (4, 4096, 4096), (1, 32768, 32768), (1, 2048, 131072)]
    scale = D**-0.5
    for b, q_len, seq in cases:
        k_cache, v_cache, cu, sl, sets = paged_case([q_len] * b, [seq] * b)
        q, bt = sets[0]
        caches = {"bfloat16": (k_cache, v_cache),
                  "fp8": (quantize_fp8(k_cache, 0.5), quantize_fp8(v_cache, 0.5))}
        del k_cache, v_cache
        flops = 4 * b * H * D * q_len * (seq - q_len + (q_len + 1) / 2)
        base = None
        for cache, (kc, vc) in caches.items():
            kernels = [None]
            if cache == "fp8":
                kernels += ["portable", "hopper"] if hopper.available(q, kc) else []
            for kernel in kernels:
                out = torch.empty_like(q)
                env = {} if kernel is None else {hopper.ENV: kernel}
                scales = {"k_scale": 0.5, "v_scale": 0.5} if cache == "fp8" else {}

                def run(env=env, kc=kc, vc=vc, out=out, scales=scales, args=(q, bt, sl, cu),
                        q_len=q_len, seq=seq):
                    q_, bt_, sl_, cu_ = args
                    with mock.patch.dict(os.environ, env):
                        pa.paged_attention(q_, kc, vc, bt_, sl_, cu_, scale, max_query_len=q_len,
                                           max_seq_len=seq, out=out, **scales)
                run()
                if base is None:
                    base = out.float()  # bf16 as served: what FP8 storage moves it from
                err = ((out.float() - base).norm() / base.norm()).item()
                ms = bench(run)
                # the bf16 cache as served is the table's reference for the FP8 rows
                impl = "bf16_cache" if cache == "bfloat16" else \
                    "pagedserve" + (f"_{kernel}" if kernel else "")
                record(kind="prefill_fp8", impl=impl, batch=b, ctx=seq, q_len=q_len, ms=ms,
                       tflops=flops / ms / 1e9, dtype=str(DT), kv_cache_dtype=cache,
                       block_size=BS, rel_err_vs_bf16_cache=err)
                ROWS.append(f"prefill {cache:8s} {impl:19s} B={b:<3d} L={q_len:<6d} "
                            f"ctx={seq:<6d} {ms:8.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s")
        del caches


@section
def mixed_and_chunked() -> None:
    scale = D**-0.5
    cases = {
        "chunked": ([2048], [16384]),  # a 2k chunk on top of 14k cached tokens
        "mixed": ([1] * 128 + [1024], [4096] * 128 + [1024]),  # 128 decodes + one prefill
    }
    if ARGS.dry:
        cases = {"chunked": ([40], [100]), "mixed": ([1] * 3 + [20], [50] * 3 + [20])}
    for name, (q_lens, ctxs) in cases.items():
        k_cache, v_cache, cu, sl, sets = paged_case(q_lens, ctxs)
        q, bt = sets[0]
        out = torch.empty_like(q)
        mq, ms_ = max(q_lens), max(ctxs)
        ms = bench(functools.partial(pa.paged_attention, q, k_cache, v_cache, bt, sl, cu, scale,
                                     max_query_len=mq, max_seq_len=ms_, out=out))
        flops = sum(4 * H * D * ql * (c - ql + (ql + 1) / 2) for ql, c in zip(q_lens, ctxs,
                                                                             strict=True))
        nbytes = sum(2 * c * HKV * D * 2 for c in ctxs) + 2 * int(cu[-1]) * H * D * 2
        record(kind=name, impl="pagedserve", batch=len(q_lens), ctx=ms_, q_len=mq, ms=ms,
               tflops=flops / ms / 1e9, tbps=nbytes / ms / 1e9, dtype=str(DT))
        ROWS.append(f"{name:7s} pagedserve B={len(q_lens):<4d} {ms:8.4f} ms "
                    f"{flops / ms / 1e9:6.1f} TFLOP/s {nbytes / ms / 1e9:5.2f} TB/s")


def timed_configs(launch, cfgs: list, out, ref, label: str):
    """(cfg, ms, relative error against ref) of each config that runs: launch(cfg, out) fills
    out, checked against ref before it is timed; a config that fails is printed and skipped."""
    for cfg in cfgs:
        try:
            run = functools.partial(launch, cfg, out)
            run()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = bench(run)
        except Exception as exc:  # noqa: BLE001
            print(f"{label} {cfg}: {exc!r}", flush=True)
            continue
        yield cfg, ms, err


@section
def sweep() -> None:
    """Decode config sweep for the next round of tuning (not the defaults' records; the long
    rows' configs are prefill_sweep's)."""
    scale = D**-0.5
    dec = [pa.Config(16, 64, 4, 2), pa.Config(16, 64, 4, 4), pa.Config(16, 128, 4, 2),
           pa.Config(16, 32, 4, 2), pa.Config(16, 64, 4, 3)]
    cases = [(8, 8192, 16), (64, 8192, 1), (256, 2048, 1)]
    if ARGS.dry:
        cases, dec = [(2, 100, 2)], dec[:2]
    for b, ctx, splits in cases:
        k_cache, v_cache, cu, sl, sets = paged_case([1] * b, [ctx] * b)
        q, bt = sets[0]
        out, ref = torch.empty_like(q), torch.empty_like(q)

        def launch(cfg, o, q=q, k_cache=k_cache, v_cache=v_cache, bt=bt, sl=sl, cu=cu,
                   splits=splits):
            pa.launch(q, k_cache, v_cache, bt, sl, cu, scale, o, cfg, per_seq=True,
                      num_splits=splits)
        launch(dec[0], ref)
        for cfg, ms, err in timed_configs(launch, dec, out, ref, "sweep decode"):
            record(kind="sweep_decode", impl="pagedserve", batch=b, ctx=ctx, ms=ms,
                   config=dataclasses.asdict(cfg), num_splits=splits, rel_err_vs_default=err)
            ROWS.append(f"sweep decode  B={b:<3d} ctx={ctx:<5d} {cfg} splits={splits} "
                        f"{ms:8.4f} ms")
        del k_cache, v_cache


@section
def prefill_sweep() -> None:
    """The long rows' launch alone over configs at the issue-32 shapes, with TFLOP/s (the
    default config first: each is checked against its output)."""
    scale = D**-0.5
    grid = [pa.Config(128, 64, 8, 3), pa.Config(128, 128, 8, 2),
            pa.Config(128, 128, 8, 3), pa.Config(128, 64, 8, 2), pa.Config(128, 64, 8, 4),
            pa.Config(128, 64, 4, 3), pa.Config(64, 64, 4, 3), pa.Config(64, 128, 4, 3),
            pa.Config(256, 64, 8, 2), pa.Config(256, 64, 16, 3), pa.Config(256, 128, 16, 2)]
    default = pa.long_config(4096, H // HKV, DT, D, hopper=pa._is_hopper(DEV))
    cfgs = [default, *(c for c in grid if c != default)]
    cases = [(1, 64)] if ARGS.dry else [(1, 8192), (4, 4096), (1, 32768)]
    if ARGS.dry:
        cfgs = cfgs[:2]
    min_q_len = pa.short_config(H // HKV).block_m // (H // HKV) + 1
    for b, seq in cases:
        k_cache, v_cache, cu, sl, sets = paged_case([seq] * b, [seq] * b)
        q, bt = sets[0]
        out, ref = torch.empty_like(q), torch.empty_like(q)
        flops = 4 * b * H * D * seq * (seq + 1) / 2

        def launch(cfg, o, q=q, k_cache=k_cache, v_cache=v_cache, bt=bt, sl=sl, cu=cu):
            pa.launch(q, k_cache, v_cache, bt, sl, cu, scale, o, cfg, per_seq=False,
                      min_q_len=min_q_len)
        launch(cfgs[0], ref)
        for cfg, ms, err in timed_configs(launch, cfgs, out, ref, f"prefill_sweep {b}x{seq}"):
            record(kind="sweep_prefill", impl="pagedserve", batch=b, ctx=seq, q_len=seq, ms=ms,
                   tflops=flops / ms / 1e9, config=dataclasses.asdict(cfg),
                   rel_err_vs_default=err, dtype=str(DT))
            ROWS.append(f"prefill_sweep B={b} L={seq:<6d} {cfg} {ms:8.4f} ms "
                        f"{flops / ms / 1e9:6.1f} TFLOP/s err {err:.1e}")
        del k_cache, v_cache


def _rotary_then_cache(pos, q, k, v, cs, kc, vc, slots):
    """The two launches rotary_and_cache replaces."""
    rq, rk = fused.rotary_embedding(pos, q, k, cs)
    kv_cache.write_kv_cache(rk, v, kc, vc, slots)
    return rq


@section
def fused_ops() -> None:
    hidden, inter = (96, 200) if ARGS.dry else (4096, 14336)
    max_pos = 8192
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEV).float() / D)
    ang = torch.arange(max_pos, device=DEV).float()[:, None] * inv[None, :]
    cs = torch.cat((ang.cos(), ang.sin()), dim=-1)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(DT)
    for t in ([4, 16] if ARGS.dry else [256, 16384]):
        el = DT.itemsize
        x = torch.randn(t, hidden, device=DEV, dtype=DT)
        r = torch.randn(t, hidden, device=DEV, dtype=DT)
        qkv = torch.randn(t, H + 2 * HKV, D, device=DEV, dtype=DT)
        q, k = qkv[:, :H], qkv[:, H:H + HKV]
        pos = torch.randint(0, max_pos, (t,), device=DEV)
        g = torch.randn(t, 2 * inter, device=DEV, dtype=DT)
        v = qkv[:, H + HKV:]
        kc, vc = (torch.empty(t // 16 + 1, 16, HKV, D, device=DEV, dtype=DT) for _ in range(2))
        slots = torch.randperm(t, device=DEV)
        part = functools.partial
        ops = {
            "rms_norm": (part(fused.rms_norm, x, w, 1e-5, r),
                         part(reference.rms_norm, x, w, 1e-5, r), 4 * t * hidden * el),
            "rotary": (part(fused.rotary_embedding, pos, q, k, cs),
                       part(reference.rotary_embedding, pos, q, k, cs),
                       2 * t * (H + HKV) * D * el + t * D * 4),
            "silu_and_mul": (part(fused.silu_and_mul, g), part(reference.silu_and_mul, g),
                             3 * t * inter * el),
            # against the two Triton launches it replaces (the peer named "pair"): bytes of
            # q and k read and q written, k and v stored, v read, the cos/sin rows
            "rotary_and_cache": (part(fused.rotary_and_cache, pos, q, k, v, cs, kc, vc, slots),
                                 part(_rotary_then_cache, pos, q, k, v, cs, kc, vc, slots),
                                 2 * t * (H + 2 * HKV) * D * el + t * D * 4, "pair"),
        }
        for name, (ours, peer, nbytes, *peer_name) in ops.items():
            a, b = ours(), peer()
            a, b = (a, b) if isinstance(a, torch.Tensor) else (a[0], b[0])
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            peer_name = peer_name[0] if peer_name else "torch"
            for impl, fn in (("pagedserve", ours), (peer_name, peer)):
                ms = bench(fn)
                record(kind=name, impl=impl, rows=t, ms=ms, tbps=nbytes / ms / 1e9,
                       dtype=str(DT), **{f"rel_err_vs_{peer_name}": err})
                ROWS.append(f"{name:12s} {impl:10s} T={t:<6d} {ms * 1e3:9.1f} us "
                            f"{nbytes / ms / 1e9:6.2f} TB/s")


def main() -> None:
    out_dir = Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(META), flush=True)
    if DEV.type == "cuda":
        print(torch.cuda.get_device_properties(0), flush=True)
    if not ARGS.skip_tests and not ARGS.sections:
        run_tests()
    torch.manual_seed(0)
    ceilings()
    decode()
    prefill()
    prefill_fp8()
    mixed_and_chunked()
    fused_ops()
    sweep()
    prefill_sweep()
    day = datetime.date.today().isoformat()
    path = out_dir / f"kernels_{day}.jsonl"
    with path.open("a") as f:  # two runs in one call (gpu.sh's parts) keep both
        f.write("".join(json.dumps(r) + "\n" for r in RECORDS))
    print(f"\nwrote {len(RECORDS)} records to {path}\n")
    print("\n".join(ROWS))


if __name__ == "__main__":
    main()
