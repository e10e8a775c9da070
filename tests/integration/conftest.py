from __future__ import annotations

import pytest
import torch

from tests.integration.service import Service

MAX_TOKENS = 24
BUDGET = 64  # max_num_batched_tokens of the main service: the long prompt is chunked

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books quickly and cheaply. Before that, texts were copied by "
    "hand, usually by monks in monasteries, and a single book could take months to finish. "
    "The new technology spread across Europe within decades, and by 1500 printing shops in "
    "more than two hundred cities had produced millions of copies. Summarize this in one line:"
)
PROMPTS = [  # (kind, content): 8 prompts of different lengths, raw and chat
    ("text", "The capital of France is"),
    ("text", "def fibonacci(n):"),
    ("text", "Once upon a time, in a land far away, there lived a"),
    ("text", LONG_TEXT),
    ("chat", "What is the capital of France?"),
    ("chat", "Write a haiku about the sea."),
    ("chat", "Explain in one sentence what a GPU is."),
    ("chat", "List three primary colors."),
]


def prompt_ids(tokenizer, kind, content):
    if kind == "text":
        return tokenizer.encode(content)
    enc = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                        add_generation_prompt=True, tokenize=True)
    return list(enc if isinstance(enc, list) else enc["input_ids"])


def request_kwargs(kind, content):
    return {"text": content} if kind == "text" else {"chat": [("user", content)]}


@pytest.fixture(scope="session")
def hf_greedy(model_dir, tokenizer):
    """HF transformers greedy continuations (fp32), the oracle every path must reproduce."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    for kind, content in PROMPTS:
        ids = prompt_ids(tokenizer, kind, content)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or 2)
        outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="session")
def service(tmp_path_factory, model_dir):
    svc = Service(tmp_path_factory.mktemp("svc") / "serve.log",
                  "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "16")
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0


@pytest.fixture(scope="session")
def tight_service(tmp_path_factory, model_dir):
    """So few KV blocks (10 x 16 tokens) that the long prompt, 126 tokens with its answer, needs
    8 of them: with the 8 prompts sent together, requests must be preempted."""
    svc = Service(tmp_path_factory.mktemp("tight") / "serve.log",
                  "--max-num-batched-tokens", "256", "--num-kv-blocks", "10",
                  "--preemption-mode", "recompute")
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0


@pytest.fixture(scope="session")
def swap_service(tmp_path_factory, model_dir):
    """As tight_service, but victims are swapped to host memory instead of recomputed."""
    svc = Service(tmp_path_factory.mktemp("swap") / "serve.log",
                  "--max-num-batched-tokens", "256", "--num-kv-blocks", "10",
                  "--preemption-mode", "swap", "--swap-space-gib", "0.25")
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0


@pytest.fixture(scope="session")
def queue_service(tmp_path_factory, model_dir):
    """One sequence at a time and one waiting request at most: queueing and priorities."""
    svc = Service(tmp_path_factory.mktemp("queue") / "serve.log",
                  "--max-num-seqs", "1", "--max-waiting-requests", "1")
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0
