"""A fix for Triton's CPU interpreter (TRITON_INTERPRET=1), used by the tests and by the GPU
benchmarks' CPU smoke runs. The service itself never runs Triton on a CPU (torch backend)."""

from __future__ import annotations


def fix_interpreter_index() -> None:
    """Triton 3.6's interpreter holds scalars as shape-(1,) arrays and converts them with
    int(), which numpy >= 2.4 rejects, so `range(runtime_bound)` fails inside kernels (e.g. the
    split-K loop of kernels/w4a16.py). Convert via the single element instead. Idempotent."""
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor
    if getattr(orig, "_pagedserve_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagedserve_fixed = True
    interp._patch_lang_tensor = patched
