"""The engine core's settings from the command line (the scheduler's flags, flags.py), shared
by the one-process scheduler (api/server.py) and the engine core's own process
(engine_main.py)."""

from __future__ import annotations

import argparse
import logging

from pagedserve.core.link_security import (
    LinkSecurityError,
    allowed_keys,
    check_exposure,
    load_keypair,
)
from pagedserve.scheduler.executor_link import LinkConfig
from pagedserve.scheduler.scheduler import SchedulerConfig
from pagedserve.scheduler.telemetry import request_log


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           long_prefill_token_threshold=args.long_prefill_token_threshold,
                           enable_prefix_caching=args.enable_prefix_caching,
                           priority_aging_steps=args.priority_aging_steps,
                           max_waiting_requests=args.max_waiting_requests,
                           max_waiting_prompt_tokens=args.max_waiting_prompt_tokens,
                           preemption_mode=args.preemption_mode,
                           swap_min_tokens=args.swap_min_tokens)


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
