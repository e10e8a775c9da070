from __future__ import annotations

import pytest
import torch

from tests.integration.service import Service

MAX_TOKENS = 24
BUDGET = 64  # max_num_batched_tokens of the main service: the long prompt is chunked
TIGHT = ("--max-num-batched-tokens", "256", "--num-kv-blocks", "10")  # forces preemption

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


_stopping: list[Service] = []  # told to stop, their exit codes checked at the session's end


def _serving(tmp_path_factory, name: str, *flags: str):
    """Run `pagedserve serve` with flags for the fixture's scope; at its end the service is
    told to stop and drains while the suite goes on, and it must have exited 0 by the end of
    the session (the services of the whole session stop together, not one after another)."""
    svc = Service(tmp_path_factory.mktemp(name) / "serve.log", *flags)
    svc.wait_serving()
    yield svc
    svc.begin_stop()
    _stopping.append(svc)


@pytest.fixture(scope="session", autouse=True)
def _services_stop_cleanly():
    """Last to end: every service _serving started has exited 0."""
    yield
    codes = {svc.log_path.parent.name: svc.wait_stopped() for svc in _stopping}
    assert all(code == 0 for code in codes.values()), codes


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
    """The main service: its engine core in a process of its own with two API processes, so
    that every suite on it runs through the engine socket (the one-process scheduler is the
    other services', and the Stack's)."""
    yield from _serving(tmp_path_factory, "svc", "--api-server-count", "2",
                        "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "16")


@pytest.fixture(scope="session")
def interval_service(tmp_path_factory, model_dir):
    """Streams one message per 4 tokens after the first (--stream-interval 4)."""
    yield from _serving(tmp_path_factory, "interval", "--stream-interval", "4")


@pytest.fixture(scope="session")
def sync_service(tmp_path_factory, model_dir):
    """The main service's flags without async scheduling (on by default): one step in
    flight; its engine core with one API process."""
    yield from _serving(tmp_path_factory, "sync", "--no-async-scheduling", "--api-server-count",
                        "1",
                        "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "16")


@pytest.fixture(scope="session")
def sync_tight_service(tmp_path_factory, model_dir):
    """The tight KV pool without async scheduling (tight_service has it: preemptions happen
    between in-flight steps there)."""
    yield from _serving(tmp_path_factory, "sync_tight", "--no-async-scheduling", *TIGHT,
                        "--preemption-mode", "recompute")


@pytest.fixture(scope="session")
def tight_service(tmp_path_factory, model_dir):
    """So few KV blocks (10 x 16 tokens) that the long prompt, 126 tokens with its answer, needs
    8 of them: with the 8 prompts sent together, requests must be preempted."""
    yield from _serving(tmp_path_factory, "tight", *TIGHT, "--preemption-mode", "recompute")


@pytest.fixture(scope="session")
def swap_service(tmp_path_factory, model_dir):
    """As tight_service, but victims are swapped to host memory instead of recomputed."""
    yield from _serving(tmp_path_factory, "swap", *TIGHT, "--preemption-mode", "swap",
                        "--swap-space-gib", "0.25")


@pytest.fixture(scope="session")
def queue_service(tmp_path_factory, model_dir):
    """One sequence at a time and one waiting request at most: queueing and priorities."""
    yield from _serving(tmp_path_factory, "queue", "--max-num-seqs", "1",
                        "--max-waiting-requests", "1")


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The served model in HF transformers, fp32 on the CPU: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
