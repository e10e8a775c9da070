"""What both kinds of scheduler process share (the one-process scheduler, api/server.py, and
the engine core's own process, engine_main.py): the engine's settings from the command line
(flags.py), the request log, and the --profile-dir profile."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import logging
import pstats
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedserve.core.chat_template import read_chat_template
from pagedserve.core.link_security import (
    LinkSecurityError,
    allowed_keys,
    check_exposure,
    load_keypair,
)
from pagedserve.core.lora import lora_config
from pagedserve.core.models import resolve_model
from pagedserve.core.speculative import SpeculativeConfig
from pagedserve.scheduler.executor_link import LinkConfig
from pagedserve.scheduler.scheduler import SchedulerConfig
from pagedserve.scheduler.telemetry import request_log


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           long_prefill_token_threshold=args.long_prefill_token_threshold,
                           long_prefill_decode_share=args.long_prefill_decode_share,
                           enable_prefix_caching=args.enable_prefix_caching,
                           priority_aging_steps=args.priority_aging_steps,
                           max_waiting_requests=args.max_waiting_requests,
                           max_waiting_prompt_tokens=args.max_waiting_prompt_tokens,
                           preemption_mode=args.preemption_mode,
                           swap_min_tokens=args.swap_min_tokens,
                           speculative=SpeculativeConfig.parse(args.speculative_config),
                           max_loras=lora.max_loras if (lora := lora_config(args)) else 0,
                           lora_modules=lora.modules if lora else ())


def link_config(args: argparse.Namespace) -> LinkConfig:
    """The executor link's settings, its keys checked (LinkSecurityError names the problem)."""
    if bool(args.scheduler_key) != bool(args.executor_allowed_keys):
        raise LinkSecurityError("give both --scheduler-key and --executor-allowed-keys, or "
                                "neither")
    check_exposure(args.executor_bind, bool(args.scheduler_key), args.insecure_executor_link)
    if args.scheduler_key:
        load_keypair(args.scheduler_key)
        allowed_keys(args.executor_allowed_keys)
    return LinkConfig(args.executor_timeout_s, args.executor_heartbeat_timeout_s,
                      args.scheduler_key, args.executor_allowed_keys, args.insecure_executor_link,
                      args.executor_link_timeout_s)


def setup_request_log() -> None:
    """Completion records go to stderr as bare JSON lines (one object each), not prefixed."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False


log = logging.getLogger("pagedserve.scheduler")


async def load_tokenizer(args: argparse.Namespace) -> tuple[Path, Any]:
    """--model's directory and the tokenizer (--tokenizer's, else the model's), loaded off
    the event loop, with --chat-template's template where one is given."""
    model_dir = resolve_model(args.model)
    tokenizer_dir = resolve_model(args.tokenizer) if args.tokenizer else model_dir
    tokenizer = await asyncio.to_thread(auto_tokenizer, Path(tokenizer_dir))
    if getattr(args, "chat_template", ""):
        tokenizer.chat_template = read_chat_template(args.chat_template)
    return model_dir, tokenizer


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def auto_tokenizer(folder: Path) -> Any:
    """AutoTokenizer.from_pretrained(folder). Where tokenizer_config.json names the generic
    fast tokenizer and tokenizer.json is there (what AutoTokenizer then builds anyway), that
    class directly: AutoTokenizer first reads the model's config through transformers'
    configuration classes, which import torch, 2-3 s of CPU at every engine core's and API
    process's start."""
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@contextlib.contextmanager
def profiled(folder: str, name: str) -> Iterator[None]:
    """cProfile the process while the block runs (folder "": not at all), then write
    NAME.prof (for pstats or snakeviz) and a readable NAME_top.txt: this package's own
    functions by cumulative time (start-up's imports would fill an unfiltered top), then
    everything by own time."""
    if not folder:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(out / f"{name}.prof")
        with (out / f"{name}_top.txt").open("w") as f:
            stats = pstats.Stats(profiler, stream=f)
            stats.sort_stats("cumulative").print_stats("scheduler_svc|pagedserve", 60)
            stats.sort_stats("tottime").print_stats(60)
        log.info("wrote the %s profile to %s", name, out)
