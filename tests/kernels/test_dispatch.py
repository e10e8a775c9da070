from __future__ import annotations

import pytest

from pagedserve import kernels
from pagedserve.kernels import reference

OPS = ("write_kv_cache", "paged_attention", "rms_norm", "rotary_embedding", "rotary_and_cache",
       "silu_and_mul")


def test_torch_backend_is_reference():
    ops = kernels.get_ops("torch")
    for name in OPS:
        assert getattr(ops, name) is getattr(reference, name)


def test_triton_backend_has_every_op():
    ops = kernels.get_ops("triton")
    for name in OPS:
        fn = getattr(ops, name)
        assert fn is not getattr(reference, name)
        assert fn.__module__.startswith("pagedserve.kernels.")


def test_unknown_backend():
    with pytest.raises(ValueError):
        kernels.get_ops("cuda")
