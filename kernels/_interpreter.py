"""Fixes for Triton's CPU interpreter (TRITON_INTERPRET=1), used by the tests and by the GPU
benchmarks' CPU smoke runs. The service itself never runs Triton on a CPU (torch backend)."""

from __future__ import annotations


def fix_interpreter_index() -> None:
    """Triton 3.6's interpreter holds scalars as shape-(1,) arrays and converts them with
    int(), which numpy >= 2.4 rejects, so `range(runtime_bound)` fails inside kernels (e.g. the
    split-K loop of kernels/w4a16.py). Convert via the single element instead. Idempotent.
    Also applies fix_interpreter_fp8() and fix_interpreter_bf16_dot()."""
    import triton.runtime.interpreter as interp

    fix_interpreter_fp8()
    fix_interpreter_bf16_dot()
    orig = interp._patch_lang_tensor
    if getattr(orig, "_pagedserve_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagedserve_fixed = True
    interp._patch_lang_tensor = patched


def fix_interpreter_fp8() -> None:
    """The interpreter's float -> float8e4nv cast (triton 3.6 to 3.9, `_convert_float`) rounds
    by adding the first cut-off bit to the 3-bit mantissa without carrying into the exponent:
    125.2 becomes 64, not 128, whenever the exponent is odd. The GPU's cvt.rn.satfinite rounds
    to nearest even; so does torch's cast, which this routes fp32 -> e4m3fn through (the
    kernels clamp to +-448 first, so saturation never differs). Loads of fp8 (the upcast) are
    exact in the interpreter and stay as they are. Idempotent."""
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interp

    orig = interp._convert_float
    if getattr(orig, "_pagedserve_fixed", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)
        return orig(input, input_dtype, output_dtype, rounding_mode)

    convert._pagedserve_fixed = True
    interp._convert_float = convert


def fix_interpreter_bf16_dot() -> None:
    """Triton 3.9's interpreter holds bf16 arrays as uint16 and multiplies a tl.dot's bf16
    tiles as those raw bits (off by ~1e10). Widen bf16 operands to float32 first, exactly, as
    a GPU's tensor cores multiply them (products exact, sums in float32). Idempotent."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    orig = interp.InterpreterBuilder.create_dot
    if getattr(orig, "_pagedserve_fixed", False):
        return

    def create_dot(self, a, b, *rest):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a, b = self.cast_impl(a, tl.float32), self.cast_impl(b, tl.float32)
        return orig(self, a, b, *rest)

    create_dot._pagedserve_fixed = True
    interp.InterpreterBuilder.create_dot = create_dot
