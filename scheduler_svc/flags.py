"""The scheduler's command-line flags. Kept apart from server.py so that building the
command line (`pagedserve --help`, `pagedserve health`) imports nothing heavy."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pagedserve.core.config import (
    add_insecure_link_arg,
    add_link_timeout_arg,
    add_speculative_arg,
    add_step_args,
)
from pagedserve.core.lora import add_lora_args


def add_args(p: argparse.ArgumentParser) -> None:
    """The scheduler's flags; defaults come through pagedserve.core.config (env, config file)."""
    p.add_argument("--host", default="0.0.0.0",
                   help="bind host of the gRPC, HTTP and metrics ports")
    p.add_argument("--port", type=int, default=50051, help="gRPC port of the public API")
    p.add_argument("--executor-bind", default="tcp://127.0.0.1:5557",
                   help="ZeroMQ address the executor connects to (tcp:// or ipc://); one that "
                        "other hosts can reach needs keys (--scheduler-key)")
    p.add_argument("--scheduler-key", default="",
                   help="the scheduler's CURVE key pair for the executor link, a "
                        "NAME.key_secret file made by `pagedserve keys`; with it the link is "
                        "encrypted and only executors in --executor-allowed-keys get in")
    p.add_argument("--executor-allowed-keys", default="",
                   help="directory of the executors' public keys (NAME.key files)")
    add_insecure_link_arg(p)
    add_link_timeout_arg(p)
    p.add_argument("--api-keys", default="",
                   help="YAML file of API keys and their tenants (priority range, concurrent "
                        "requests, tokens per minute; see scheduler_svc/api/tenants.py); clients "
                        "send 'authorization: Bearer <key>'. Empty: the API is open to anyone "
                        "who reaches the port")
    p.add_argument("--tls-cert", default="",
                   help="PEM certificate chain: the gRPC API (and /metrics) speak TLS; files "
                        "are re-read when they change or on SIGHUP")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default="",
                   help="PEM CA certificates: clients must present a certificate they signed "
                        "(mutual TLS)")
    p.add_argument("--max-input-bytes", type=int, default=0,
                   help="most UTF-8 bytes of text or chat input per request, refused before "
                        "tokenizing (0: 32 per token of max_model_len; the model config's "
                        "until an executor joins); an HTTP body may have twice this plus 1 MiB")
    p.add_argument("--enable-reflection", action=argparse.BooleanOptionalAction, default=True,
                   help="gRPC server reflection (grpcurl lists and calls the API without the "
                        ".proto)")
    p.add_argument("--http-port", type=int, default=8080,
                   help="port of the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health), same keys and TLS as the "
                        "gRPC API (0 disables)")
    p.add_argument("--metrics-port", type=int, default=8000,
                   help="Prometheus /metrics HTTP port (0 disables)")
    p.add_argument("--tokenizer", default="",
                   help="directory of the tokenizer (empty: --model's); e.g. for a config-only "
                        "directory served with --load-format random")
    p.add_argument("--chat-template", default="",
                   help="Jinja chat template replacing the tokenizer's: a file's path, or the "
                        "template itself (a value with {, } or a newline); empty: the "
                        "tokenizer's own")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for what a request leaves unset (temperature, "
                        "top_p, top_k, min_p, repetition_penalty, max_tokens): auto (the "
                        "model's generation_config.json, as vLLM), vllm (none: the APIs' own), "
                        "or a folder holding a generation_config.json")
    p.add_argument("--served-model-name", default="",
                   help="model name in GetModelInfo and the metrics' model_name label "
                        "(empty: --model)")
    add_step_args(p)
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed message after the first (1: every token at once; "
                        "larger: fewer gRPC messages, less host work per token, for "
                        "throughput-bound batch clients)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan and send step N+1 before step N's result arrives (hides the "
                        "scheduler's time per step; a request that stops costs one more token "
                        "of compute)")
    add_speculative_arg(p)
    add_lora_args(p)
    p.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with "
                        "--api-keys, to admin tenants only): a client names a directory the "
                        "executor reads (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)"),
    p.add_argument("--profile-dir", default="",
                   help="profile the scheduler process with cProfile while it runs and write "
                        "scheduler.prof and scheduler_top.txt (the top functions by cumulative "
                        "and by own time) here at exit (empty: off; slows the process)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of shared prompt prefixes")
    p.add_argument("--long-prefill-token-threshold", type=int, default=512,
                   help="most prompt tokens one request prefills per step (0: no cap)")
    p.add_argument("--long-prefill-decode-share", type=share, default=0.0,
                   help="while requests decode, the time the later chunks of long prompts may "
                        "add to their steps, as a share of the decode time, measured (0.5: "
                        "TPOT within about 1.5x; 0: never held)")
    p.add_argument("--priority-aging-steps", type=int, default=500,
                   help="a waiting request gains one priority level per this many steps")
    p.add_argument("--preemption-mode", choices=["auto", "recompute", "swap"], default="auto",
                   help="auto: swap victims with >= --swap-min-tokens computed tokens")
    p.add_argument("--swap-min-tokens", type=int, default=256,
                   help="in auto mode, the fewest computed tokens a victim needs to be swapped")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="queue bound; past it requests get RESOURCE_EXHAUSTED (0: none)")
    p.add_argument("--max-waiting-prompt-tokens", type=int, default=0,
                   help="bound on prompt tokens queued (0: none)")
    p.add_argument("--executor-timeout-s", type=float, default=120.0,
                   help="a step not answered within this many seconds means the executor is "
                        "lost: its requests are recomputed on the next executor, except that "
                        "one in a second unanswered step fails with UNAVAILABLE")
    p.add_argument("--executor-heartbeat-timeout-s", type=float, default=10.0,
                   help="an idle executor silent for this long is lost (it beats every second)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may run before they are "
                        "aborted and the process exits")
    p.add_argument("--shutdown-delay-s", type=float, default=0.0,
                   help="on SIGTERM, report not ready at once (gRPC health, HTTP /health) but "
                        "keep serving new requests this many seconds, for proxies and "
                        "Kubernetes endpoints to stop sending, before the drain (5 in the "
                        "Kubernetes manifests)")
    p.add_argument("--refuse-when-unready", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="while no executor is joined, refuse new requests with UNAVAILABLE and "
                        "a retry hint (a proxy retries them on another replica) instead of "
                        "queueing them until one joins; admitted requests are recomputed either "
                        "way")
    p.add_argument("--log-prompts", action=argparse.BooleanOptionalAction, default=False,
                   help="include the prompt text in the per-request completion log")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine socket between the engine core and its API processes (`engine`, `api`)."""
    p.add_argument("--engine-address", default="",
                   help="ZeroMQ address of the engine core's socket, which its API processes "
                        "connect to (ipc://PATH, or tcp:// on this host); empty: serve makes "
                        "an ipc:// path of its own")


class _ValueError(argparse.ArgumentTypeError, ValueError):
    """Named by argparse on the command line, by the config file's reader elsewhere."""


def share(text: str) -> float:
    """A share of time: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise _ValueError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # (NaN too)
        raise _ValueError(f"expected a number >= 0, got {text}")
    return value


def api_server_count(text: str) -> int | str:
    """--api-server-count's value: 'auto' or a count >= 0."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        raise _ValueError(f"expected auto or a count, got {text!r}") from None
    if n < 0:
        raise _ValueError(f"expected auto or a count >= 0, got {n}")
    return n


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> float:
    """The CPUs this process may run on: its affinity set, capped by a cgroup v2 CPU quota
    (a container's `cpus`, a pod's CPU limit), which the affinity set does not show."""
    cores = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = cpu_max.read_text().split()
        if quota != "max":
            cores = min(cores, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cores


def auto_api_server_count(cores: float) -> int:
    """`--api-server-count auto`: one API process per 8 usable cores, at least 1 and at most
    4. The executor and the engine core keep a core each busy under load, and an API process
    needs about one at 256 streams; on the H200's 16-core host (2 here) two API processes
    served a 1B model 23-27 % faster than the single process (docs/performance.md)."""
    return max(1, min(4, int(cores // 8)))


def add_engine_key_args(p: argparse.ArgumentParser) -> None:
    """The engine socket's CURVE keys (`pagedserve engine` and `pagedserve api` run alone, on
    different hosts; serve's socket is a private ipc:// path and needs none)."""
    p.add_argument("--engine-key", default="",
                   help="this process's key pair on the engine socket (NAME.key_secret from "
                        "`pagedserve keys`): the engine core's, or an API process's; with it "
                        "--engine-address may be reachable from other hosts")
    p.add_argument("--engine-allowed-keys", default="",
                   help="engine core: the directory of the API processes' public NAME.key "
                        "files it accepts")
    p.add_argument("--engine-public-key", default="",
                   help="API process: the engine core's public NAME.key")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """What only `serve` decides: how the scheduler side is split into processes."""
    p.add_argument("--api-server-count", type=api_server_count, default="auto",
                   help="API processes (gRPC and HTTP on shared ports, each with its own "
                        "tokenizer and detokenizer) beside an engine core in a process of its "
                        "own; auto: one per 8 usable cores, 1 to 4 (1 when API keys carry "
                        "quotas); 0: one scheduler process does both")
    add_engine_args(p)
