"""Build the Hopper paged prefill kernel (kernels/paged_prefill_hopper.py) for sm_90 on any
machine and print what ptxas made of it: registers, spills, shared memory, one JSON line per
variant. Triton lowers and ptxas assembles without a GPU (both ship in the Triton wheel), so a
variant that would spill or overflow shared memory shows here before device time is spent.

    python benchmarks/kernels/sm90_build.py [--head-dim 128] [--block-size 16] [--group 4]
        [--window] [--soft-cap] [--fp16] [--fp8] [--split]

Run it without TRITON_INTERPRET (under the interpreter, Gluon's jit functions do not build).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build_prefill(head_dim: int = 128, block_size: int = 16, group: int = 4,
                  window: bool = False, soft_cap: bool = False, fp16: bool = False,
                  split: bool = False, fp8: bool = False):
    """The compiled kernel (triton.compile's result) for these constexprs."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from pagedserve.kernels import paged_prefill_hopper as hopper

    dtype = torch.float16 if fp16 else torch.bfloat16
    ptr = "*fp16" if fp16 else "*bf16"
    cfg = hopper.config_for(head_dim)
    box = min(block_size, cfg.tile_n)
    cache_dtype = hopper.FP8_KV_DTYPE if fp8 else dtype  # (fp8: an FP8 KV cache)
    cache = torch.empty(8 * block_size, 2 * head_dim, dtype=cache_dtype)
    desc = TensorDescriptor(cache, list(cache.shape), list(cache.stride()), [box, head_dim],
                            hopper._layout([box, head_dim], cache_dtype))
    sig = {"q_ptr": ptr, "k_desc": mangle_type(desc), "v_desc": mangle_type(desc),
           "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_q_ptr": "*i32",
           "out_ptr": ptr, "part_m_ptr": "*fp32" if split else ptr,
           "part_l_ptr": "*fp32" if split else ptr, "part_acc_ptr": "*fp32" if split else ptr,
           "num_heads": "i32", "num_splits": "i32", "qk_scale": "fp32", "v_scale": "fp32",
           "num_seqs": "i32",
           "min_q_len": "i32",
           "window": "i32", "soft_cap": "fp32", "past_end": "i32", "stride_qt": "i32",
           "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32"}
    consts = dict(GROUP=group, BLOCK_Q=cfg.block_m // group, BLOCK_M=cfg.block_m,
                  HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE_N=cfg.tile_n,
                  NUM_STAGES=cfg.num_stages, HAS_WINDOW=window, SOFT_CAP=soft_cap,
                  SPLIT=split, FP8=fp8, num_warps=cfg.num_warps)
    sig.update({n: "constexpr" for n in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values())
             if ty.startswith("*")}
    src = GluonASTSource(fn=hopper._prefill_kernel, signature=sig, constexprs=consts,
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "maxnreg": hopper.MAXNREG})


def ptxas_report(compiled) -> dict:
    """Registers, spill bytes and shared memory of a compiled kernel (ptxas -v on its PTX)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the one Triton assembled with (its PTX version's)
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        err = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o",
                              "/dev/null"], capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", err)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", err)]
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": sum(spills),
            "shared_bytes": compiled.metadata.shared,
            "serialized_wgmma": "serialized" in err}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--window", action="store_true")
    p.add_argument("--soft-cap", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--split", action="store_true", help="the key-split variant (partials out)")
    p.add_argument("--fp8", action="store_true", help="over an FP8 (e4m3) KV cache")
    a = p.parse_args()
    variant = {"head_dim": a.head_dim, "block_size": a.block_size, "group": a.group,
               "window": a.window, "soft_cap": a.soft_cap, "fp16": a.fp16, "split": a.split,
               "fp8": a.fp8}
    print(json.dumps({**variant, **ptxas_report(build_prefill(**variant))}))


if __name__ == "__main__":
    main()
