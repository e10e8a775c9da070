import logging

from pagedserve.executor.jit_watch import JitWatch


def test_logs_each_compile_with_its_specialisation(caplog):
    watch = JitWatch()
    with caplog.at_level(logging.WARNING, logger="pagedserve.executor"):
        assert watch._before(key=1) is False  # never skips the compile
        assert watch._after(repr="_paged_attn_kernel[num_warps=4](stride_bt: i32)") is False
    assert watch.compiles == 1
    (rec,) = caplog.records
    assert "mid-serving" in rec.getMessage()
    assert rec.getMessage().endswith("_paged_attn_kernel[num_warps=4](stride_bt: i32)")


def test_install_sets_both_triton_hooks():
    from triton import knobs

    watch = JitWatch()
    old = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        assert watch.install()
        assert knobs.runtime.jit_cache_hook == watch._before
        assert knobs.runtime.jit_post_compile_hook == watch._after
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = old
