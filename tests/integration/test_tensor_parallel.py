"""`serve --tensor-parallel-size 2 --async-scheduling` on the CPU (gloo): the default model's
9 query / 3 KV heads split 6+3 / 2+1 over two ranks; a decode row's input id, the previous
step's sample, reaches rank 1 by the broadcast without a host read. Greedy outputs equal HF's
under preemption with prefix caching on, and a LoRA adapter's equal HF's on the merged weights;
a rank killed for real is the executor lost: the group goes, serve restarts it, and the stream
in flight completes with HF's tokens."""

from __future__ import annotations

import time

import psutil
import pytest

from pagedserve.client import build_request
from tests.integration.conftest import TIGHT, _serving
from tests.integration.service import health
from tests.integration.test_generation import run_until_preempted

CHAT = [("user", "What is the capital of France?")]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, hf_model):
    """A LoRA adapter of every module of the default model (rank 8)."""
    from tests.executor_svc.test_lora_adapters import _PLACE, write_adapter

    return write_adapter(tmp_path_factory.mktemp("adapter"), hf_model, 5, 8, list(_PLACE), 16,
                         std=0.1)


@pytest.fixture(scope="module")
def tp_service(tmp_path_factory, model_dir, adapter):
    yield from _serving(tmp_path_factory, "tp2", "--tensor-parallel-size", "2", *TIGHT,
                        "--async-scheduling",
                        "--preemption-mode", "recompute", "--enable-prefix-caching",
                        "--enable-lora", "--lora-modules", f"tuned={adapter}",
                        "--max-lora-rank", "8")


def ranks(svc) -> tuple[psutil.Process, list[psutil.Process]]:
    """serve's executor process (rank 0) and its followers."""
    [rank0] = [p for p in psutil.Process(svc.proc.pid).children() if "executor" in p.cmdline()]
    return rank0, [p for p in rank0.children() if "spawn_main" in " ".join(p.cmdline())
                   and "resource_tracker" not in " ".join(p.cmdline())]


def test_two_ranks_match_hf_under_preemption_with_prefix_caching(tp_service, hf_greedy,
                                                                  tokenizer):
    _, followers = ranks(tp_service)
    assert len(followers) == 1
    m = run_until_preempted(tp_service, "recompute", hf_greedy, tokenizer)
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"] == 10
    assert m["pagedserve_prefix_cache_hits_total"] > 0  # the chat prompts share a template
    assert "tensor parallel group of 2 ranks on cpu (gloo)" in tp_service.log_path.read_text()


def test_an_adapter_on_two_ranks_equals_hf_on_the_merged_weights(tp_service, hf_model, adapter,
                                                                 tokenizer):
    """Each rank holds its share of the adapter (9 heads split 6 + 3): the adapter's greedy
    tokens equal HF's on the merged weights, and differ from the base's."""
    import torch

    from tests.executor_svc.test_lora_adapters import merged

    ids = tokenizer("The capital of France is")["input_ids"]
    with torch.no_grad():
        want = merged(hf_model, adapter).generate(torch.tensor([ids]), max_new_tokens=8,
                                                  do_sample=False, pad_token_id=2)[0, len(ids):]
    got = tp_service.client.complete(token_ids=ids, max_tokens=8, temperature=0,
                                     adapter="tuned")[1]
    base = tp_service.client.complete(token_ids=ids, max_tokens=8, temperature=0)[1]
    assert got == want.tolist()
    assert got != base


def test_a_rank_killed_mid_stream_restarts_the_group_and_the_stream_completes(
        tp_service, hf_greedy):
    rank0, [rank1] = ranks(tp_service)
    stream = tp_service.client.stub.Generate(
        build_request(chat=CHAT, temperature=0, max_tokens=24), timeout=180)
    ids = list(next(stream).token_ids)
    rank1.kill()
    for chunk in stream:  # recomputed on the restarted group
        ids.extend(chunk.token_ids)
    assert ids == hf_greedy[4]
    assert not rank0.is_running() or rank0.status() == psutil.STATUS_ZOMBIE
    log = tp_service.log_path.read_text()
    assert "tensor parallel tp-rank-1 exited with -9: the executor is lost" in log
    assert "executor exited with 1; restarting" in log
    deadline = time.monotonic() + 60
    while health(tp_service.client.channel) is None or len(ranks(tp_service)[1]) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    new0, [new1] = ranks(tp_service)
    assert (new0.pid, new1.pid) != (rank0.pid, rank1.pid)
