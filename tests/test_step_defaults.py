"""Default step bounds follow the device as vLLM's API server's do, and async scheduling is on."""

from types import SimpleNamespace

import pytest
import torch

from pagedserve.cli import _parser
from pagedserve.core.config import step_bounds
from pagedserve.executor.worker import ExecutorConfig, resolve_step_bounds

GiB = 1 << 30


@pytest.mark.parametrize("name,memory,want", [
    ("NVIDIA H200", 143_771_287_552, (1024, 8192)),  # what torch reports for the lent H200
    ("NVIDIA H100 80GB HBM3", 85_029_158_912, (1024, 8192)),
    ("AMD Instinct MI300X", 205_822_885_888, (1024, 8192)),
    ("NVIDIA A100-SXM4-80GB", 85_097_971_712, (256, 2048)),  # vLLM PR #17885: slower there
    ("NVIDIA L40S", 47_697_362_944, (256, 2048)),
    ("NVIDIA GeForce RTX 4090", 25_393_692_672, (256, 2048)),
    ("just under the line", 70 * GiB - 1, (256, 2048)),
    ("at the line", 70 * GiB, (1024, 8192)),
])
def test_cuda_cards_get_vllms_defaults(name, memory, want):
    assert step_bounds("cuda", memory, name) == want


def test_the_cpu_keeps_small_steps():
    assert step_bounds("cpu") == (128, 2048)
    cfg = resolve_step_bounds(ExecutorConfig("m", max_num_seqs=0, max_num_batched_tokens=0),
                              torch.device("cpu"))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (128, 2048)


@pytest.mark.parametrize("seqs,tokens,want", [(0, 0, (1024, 8192)), (512, 0, (512, 8192)),
                                              (0, 32768, (1024, 32768)), (64, 512, (64, 512))])
def test_the_executor_fills_only_the_bounds_left_at_0(monkeypatch, seqs, tokens, want):
    """Device properties faked as the H200's: an explicit bound is kept, a 0 one filled."""
    h200 = SimpleNamespace(name="NVIDIA H200", total_memory=143_771_287_552)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    cfg = resolve_step_bounds(ExecutorConfig("m", max_num_seqs=seqs,
                                             max_num_batched_tokens=tokens),
                              torch.device("cuda"))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == want


@pytest.mark.parametrize("command", ["serve", "scheduler", "executor"])
def test_flags_leave_the_step_bounds_to_the_device(command):
    args = _parser({}, {}).parse_args([command])
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (0, 0)


@pytest.mark.parametrize("argv,want", [([], True), (["--no-async-scheduling"], False)])
def test_async_scheduling_is_on_by_default(argv, want):
    assert _parser({}, {}).parse_args(["serve", *argv]).async_scheduling is want
