"""Static look at the W4A16 kernels' sm_90 machine code, without a GPU.

Triton compiles for sm_90 on any machine (the wheel ships ptxas and nvdisasm), so the inner
K loop's instructions can be counted here. The count predicts the instruction-issue bound:

    cycles per K tile per SM  = loop instructions x warps / 4   (4 schedulers, 1 issue/clk)
    weight bytes per second   = BLOCK_K x BLOCK_N / 2 / (that) x SMs x clock

An upper bound, well above what the H200 measures (docs/kernels.md, "W4A16 GEMMs"); HBM is
~4.8 TB/s. It ranks variants before any device time is spent, and shows which instructions a
change removed.

    python benchmarks/quant/sass_w4a16.py [--rows 1 4 16] [--dump DIR] [--tiled] [--gluon]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.kernels import w4a16, w4a16_decode, w4a16_prefill  # noqa: E402
from pagedserve.kernels.w4a16_common import PLANE_BLOCK  # noqa: E402

SMS, CLOCK_HZ, HBM_TBS = 132, 1.98e9, 4.8  # H200 SXM
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_BRA = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+`?\(?\.(L_x_\d+)")
_LABEL = re.compile(r"^\.(L_x_\d+):")


def sass(kernel, signature, constexprs, num_warps, num_stages, *, source=ASTSource,
         options=None):
    """nvdisasm of `kernel` compiled for sm_90, pointers and ints (but M) divisible by 16, as
    they are when the model calls it. `source`: GluonASTSource for a Gluon kernel; `options`:
    more compiler options (maxnreg)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
             if ty.startswith("*") or (ty == "i32" and name != "M")}
    src = source(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       **(options or {})})
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def main_loop(text):
    """Instructions of the largest backward-branch loop: [(address, opcode)]."""
    labels, insns, branches = {}, [], []
    pending = []
    for line in text.splitlines():
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
            continue
        if m := _INSN.search(line):
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            insns.append((addr, m.group(2)))
            if b := _BRA.search(line):
                branches.append((addr, b.group(2)))
    best = []
    for addr, label in branches:
        start = labels.get(label, addr + 1)
        if start < addr:
            body = [(a, op) for a, op in insns if start <= a <= addr]
            if len(body) > len(best):
                best = body
    return best


def classify(op):
    base = op.split(".")[0]
    groups = {
        "global load": ("LDG", "LDGSTS"), "shared": ("LDS", "STS", "LDSM", "LDGDEPBAR"),
        "tensor core": ("HMMA", "HGMMA"), "fp32": ("FFMA", "FADD", "FMUL", "FMNMX"),
        "packed 16-bit": ("HFMA2", "HADD2", "HMUL2"), "convert": ("F2F", "F2FP", "I2F", "F2I"),
        "int/logic": ("LOP3", "SHF", "IADD3", "IMAD", "PRMT", "LEA", "ISETP", "SEL", "MOV",
                      "IABS", "BFE"),
        "shuffle": ("SHFL",),
    }
    for name, ops in groups.items():
        if base in ops:
            return name
    return "other"


def signature(constexprs):
    """The decode and tiled kernels' arguments (bf16 activations), then `constexprs`."""
    ptr = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16",
           "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32"}
    ints = {n: "i32" for n in ("M", "N", "K", "group_size", "k_per_split", "stride_xm",
                               "stride_om")}
    return {**ptr, **ints, **{n: "constexpr" for n in constexprs}}


def analyse(cfg: w4a16_decode.DecodeConfig, dequant: str, dump: Path | None):
    """The decode kernel's K loop with DEQUANT `dequant` ("fp32", "x2", "x2planes"), whatever
    the launcher would pick: instructions, their mix and the issue bound."""
    block_k = w4a16_decode.BLOCK_K
    warps = w4a16_decode.NUM_WARPS
    consts = {"HAS_BIAS": False, "SPLIT_K": True, "DEQUANT": dequant, "BLOCK_M": 16,
              "BLOCK_N": cfg.block_n, "BLOCK_K": block_k}
    text = sass(w4a16_decode.w4a16_decode_kernel, signature(consts), consts, warps,
                w4a16_decode.NUM_STAGES)
    loop = main_loop(text)
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"decode_bn{cfg.block_n}_{dequant}.sass").write_text(text)
    mix = collections.Counter(classify(op) for _, op in loop)
    cycles = len(loop) * warps / 4
    tbs = block_k * cfg.block_n / 2 / cycles * SMS * CLOCK_HZ / 1e12
    return len(loop), mix, tbs


def analyse_tiled(cfg: w4a16_prefill.PrefillConfig):
    """The tiled kernel's K loop: instructions, barriers and shared-memory traffic per tile
    (the weight's layout conversions through shared memory show as STS and barriers)."""
    consts = {"HAS_BIAS": False, "SPLIT_K": cfg.split_k > 1, "DEQUANT": "x2",
              "PLANES": cfg.planes and cfg.block_k == PLANE_BLOCK, "BLOCK_M": cfg.block_m,
              "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
    loop = main_loop(sass(w4a16_prefill.w4a16_prefill_kernel, signature(consts), consts,
                          cfg.num_warps, cfg.num_stages))
    ops = collections.Counter(op.split(".")[0] for _, op in loop)
    return len(loop), {k: ops[k] for k in ("BAR", "STS", "LDS", "LDSM", "HGMMA", "HMMA", "LDG")}


def analyse_gluon(cfg=None):
    """The Gluon kernel (kernels/w4a16_gluon.py) built for sm_90: instruction counts over the
    whole kernel (its K loop is unrolled by two: 16 wgmmas)."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from pagedserve.kernels import w4a16_gluon

    cfg = cfg or w4a16_gluon.GluonConfig()
    xp = torch.empty(cfg.block_m, 4096, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, 128], gl.bfloat16)
    desc = TensorDescriptor(xp, list(xp.shape), list(xp.stride()), [cfg.block_m, 128], layout)
    sig = {"x_desc": mangle_type(desc), "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16",
           "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
           **{n: "i32" for n in ("M", "N", "K", "group_size", "k_per_split", "stride_om")}}
    consts = {"HAS_BIAS": False, "PARTIAL": cfg.split_k > 1, "BLOCK_M": cfg.block_m,
              "NUM_STAGES": cfg.num_stages, "num_warps": cfg.num_warps}
    sig.update({n: "constexpr" for n in consts})
    text = sass(w4a16_gluon.w4a16_gluon_kernel, sig, consts, cfg.num_warps, cfg.num_stages,
                source=GluonASTSource)
    ops = collections.Counter(m.group(2).split(".")[0] for m in map(_INSN.search,
                                                                     text.splitlines()) if m)
    return {k: ops[k] for k in ("HGMMA", "STS", "LDS", "LDG", "BAR", "STG")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--dump", type=Path)
    ap.add_argument("--tiled", action="store_true",
                    help="the tiled kernel's configs (pick_config) at 32, 64 and 128 rows")
    ap.add_argument("--gluon", action="store_true",
                    help="the Gluon kernel's default config (kernels/w4a16_gluon.py)")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    if args.gluon:
        print(f"gluon {analyse_gluon()}")
        return
    if args.tiled:
        for rows in (32, 64, 128):
            for n, k in ((4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)):
                if w4a16.use_dequant_matmul(rows, n, k):
                    continue
                cfg = w4a16.pick_config(rows, n, k)
                count, ops = analyse_tiled(cfg)
                print(f"rows {rows:>3} {n}x{k}: {cfg.block_m}x{cfg.block_n}x{cfg.block_k} "
                      f"warps={cfg.num_warps} planes={int(cfg.planes)} "
                      f"split={cfg.split_k}: {count} insns/tile {ops}")
        return
    print(f"issue bound of the K loop on an H200 ({SMS} SMs, {CLOCK_HZ / 1e9} GHz); "
          f"HBM {HBM_TBS} TB/s")
    for rows in args.rows:
        cfg = w4a16.pick_config(rows, 4096, 4096)
        for dq in ("fp32", "x2", "x2planes"):
            n, mix, tbs = analyse(cfg, dq, args.dump)
            per = ", ".join(f"{k} {v}" for k, v in mix.most_common())
            print(f"rows {rows:>2} {dq:<8} BN={cfg.block_n} BK={w4a16_decode.BLOCK_K} "
                  f"warps={w4a16_decode.NUM_WARPS}: {n} insns/iter -> "
                  f"{tbs:.2f} TB/s of int4 weight  [{per}]")


if __name__ == "__main__":
    main()
