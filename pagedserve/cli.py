"""The `pagedserve` command: serve | scheduler | executor | quantize | keys | health | generate.

The client commands (keys, health, generate) and every --help import neither torch, triton nor
transformers: heavy imports live inside the commands that run a model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.core import config
from pagedserve.core.models import ModelNotFoundError, resolve_model
from pagedserve.core.readiness import READY_ENV
from pagedserve.supervise import Supervised

log = logging.getLogger("pagedserve")
HELP = argparse.ArgumentDefaultsHelpFormatter  # every flag's help ends with its default


CONFIG_HELP = ("YAML file of settings, keys as the flags' dest names (e.g. max_num_seqs; "
               "vLLM's names where they exist); precedence: flag > env > file > default "
               "[env PAGEDSERVE_CONFIG]")


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct, GGUF)")


def _process_parser(sub, name: str, help: str, *adders) -> argparse.ArgumentParser:
    # "resolve": both processes' flags go into `serve`, and the step bounds belong to both
    p = sub.add_parser(name, help=help, formatter_class=HELP, conflict_handler="resolve")
    p.add_argument("--config", help=CONFIG_HELP)
    _model_arg(p)
    for add_args in adders:
        add_args(p)
    return p


def _parser(file_values: dict | None = None, environ=os.environ) -> argparse.ArgumentParser:
    """The command line; serve, scheduler and executor take their defaults from the config
    file's values and the environment (pagedserve.core.config)."""
    from pagedserve import quantize
    from pagedserve.executor import flags as executor
    from pagedserve.scheduler import flags as scheduler

    file_values = config.normalize(file_values or {})
    p = argparse.ArgumentParser(prog="pagedserve", description=__doc__, formatter_class=HELP)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = p.add_subparsers(dest="command", required=True)
    serve = _process_parser(sub, "serve", "run the service: an engine core, its API processes and "
                            "the executor (--api-server-count 0: scheduler and executor)",
                            scheduler.add_args, executor.add_args, scheduler.add_serve_args)
    serve.set_defaults(scheduler_address=None)
    processes = [p, serve,
                 _process_parser(sub, "scheduler", "run the scheduler process (gRPC API)",
                                 scheduler.add_args),
                 _process_parser(sub, "engine", "run the engine core alone (the scheduler "
                                 "without its API; API processes connect to it)",
                                 scheduler.add_args, scheduler.add_engine_args,
                                 scheduler.add_engine_key_args),
                 _process_parser(sub, "api", "run one API process of an engine core (gRPC and "
                                 "HTTP ports, shared with its siblings)",
                                 scheduler.add_args, scheduler.add_engine_args,
                                 scheduler.add_engine_key_args),
                 _process_parser(sub, "executor", "run the executor process (model)",
                                 executor.add_args)]
    known = {a.dest for parser in processes for a in parser._actions}
    config.check_keys(file_values, known, "config file")
    for parser in processes:
        config.apply(parser, file_values, environ)
    q = sub.add_parser("quantize", help="write a 4-bit AWQ/GPTQ checkpoint of --model",
                       formatter_class=HELP)
    _model_arg(q)
    quantize.add_args(q)
    k = sub.add_parser("keys", help="make a CURVE key pair for the executor link: DIR/NAME.key "
                                    "(public) and DIR/NAME.key_secret (kept if they exist)",
                       formatter_class=HELP)
    k.add_argument("dir", help="directory to write into")
    k.add_argument("--name", required=True,
                   help="e.g. scheduler, or executor (whose NAME.key goes into the scheduler's "
                        "--executor-allowed-keys directory)")
    h = sub.add_parser("health", help="exit 0 if the server at --address is serving",
                       formatter_class=HELP)
    _address_arg(h)
    h.add_argument("--readiness", action=argparse.BooleanOptionalAction, default=True,
                   help="check readiness (an executor is connected; the default), or with "
                        "--no-readiness liveness (the process answers)")
    g = sub.add_parser("generate", help="stream a completion from a running server",
                       formatter_class=HELP)
    for client in (h, g):
        _tls_args(client)
    _generate_args(g)
    return p


def _address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("PAGEDSERVE_ADDRESS", "localhost:50051"),
                   help="the scheduler's gRPC address, HOST:PORT [env PAGEDSERVE_ADDRESS]")


def _generate_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompt", help="prompt text, or - to read it from stdin")
    _address_arg(g)
    g.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="sent as 'authorization: Bearer <key>' [env PAGEDSERVE_API_KEY]")
    g.add_argument("--chat", action="store_true", help="send as a user message (chat template)")
    g.add_argument("--system", help="system message (with --chat)")
    # None leaves the field unset: the server's default applies (protos/.../generate.proto)
    g.add_argument("--max-tokens", type=int,
                   help="most tokens to generate (None: up to the model's context length)")
    g.add_argument("--temperature", type=float,
                   help="sampling temperature, 0 for greedy (None: 1.0)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass, in (0, 1] (None: 1.0)")
    g.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (None: all)")
    g.add_argument("--seed", type=int,
                   help="sampling seed for a reproducible answer (None: not reproducible)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token (benchmarks)")
    g.add_argument("--priority", type=int, default=0,
                   help="scheduling priority, lower runs first (within the API key's range)")
    g.add_argument("--json", action="store_true", help="one JSON object per streamed chunk")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="deadline of the whole request, seconds")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        path = config.config_path(argv, os.environ)
        args = _parser(config.load_file(path) if path else {}).parse_args(argv)
    except config.ConfigError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except ModelNotFoundError as e:  # a usage error: one line, like argparse's own
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return _generate(args)
    if args.command == "health":
        return _health(args)
    if args.command == "keys":
        from pagedserve.core.link_security import create_keypair

        for path in create_keypair(args.dir, args.name):
            print(path)
        return 0
    if args.command == "quantize":
        from pagedserve.quantize import run as quantize

        return quantize(args)
    if args.command in ("serve", "scheduler"):  # before seconds of imports; and serve would
        from pagedserve.scheduler.ports import BindError, check_addresses  # restart it 5 times

        try:
            check_addresses(args)
        except BindError as e:
            raise SystemExit(f"pagedserve {args.command}: {e}") from None
    if args.command in ("serve", "scheduler", "engine", "executor"):  # bad JSON: before imports
        from pagedserve.core.speculative import SpeculativeConfig, SpeculativeConfigError

        try:
            spec = SpeculativeConfig.parse(args.speculative_config)
            if spec is not None and args.max_num_batched_tokens:
                spec.check(1 << 62, args.max_num_batched_tokens)
        except SpeculativeConfigError as e:
            raise SystemExit(f"pagedserve {args.command}: {e}") from None
    if args.command in ("serve", "scheduler", "engine", "api", "executor"):
        from pagedserve.core.lora import lora_config

        try:
            lora_config(args)
        except ValueError as e:
            raise SystemExit(f"pagedserve {args.command}: {e}") from None
    if getattr(args, "chat_template", ""):  # a bad template fails at once, not per request
        from pagedserve.core.chat_template import ChatTemplateError, read_chat_template

        try:
            read_chat_template(args.chat_template)
        except ChatTemplateError as e:
            raise SystemExit(f"pagedserve {args.command}: {e}") from None
    if args.command in ("serve", "scheduler", "engine", "api", "executor"):
        # before the server modules' imports (seconds): a bad --model fails at once; and serve
        # converts a GGUF here once, before two processes race for it
        model_dir = resolve_model(args.model)
        if args.command in ("serve", "scheduler", "api"):  # a bad one fails at once
            from pagedserve.scheduler.api.sampling_defaults import (
                GenerationConfigError,
                sampling_defaults,
            )

            try:
                defaults = sampling_defaults(args.generation_config, Path(model_dir))
            except GenerationConfigError as e:
                raise SystemExit(f"pagedserve {args.command}: {e}") from None
            if defaults.describe() and args.command != "api":  # (serve's API processes: once)
                log.info("sampling defaults of the model for what a request leaves unset: %s "
                         "(--generation-config vllm: none)", defaults.describe())
    if args.command == "scheduler":
        from pagedserve.scheduler.api.server import run

        run(args)
        return 0
    if args.command == "engine":
        from pagedserve.scheduler.engine_main import run

        run(args)
        return 0
    if args.command == "api":
        from pagedserve.scheduler.api.server import run_api

        run_api(args)
        return 0
    if args.command == "executor":
        from pagedserve.executor.server import run

        run(args)
        return 0
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    """Start the processes and restart any that dies (pagedserve.supervise: at most 5 restarts
    in 60 s, with backoff): the engine core, its API processes (--api-server-count, by
    default one per 8 usable cores) and the executor, or with --api-server-count 0 the
    scheduler and the executor. On SIGINT/SIGTERM drain the API side first
    (the executor keeps running the admitted requests), then stop the rest."""
    from pagedserve.executor import flags as executor
    from pagedserve.scheduler import flags as scheduler

    base = [sys.executable, "-m", "pagedserve.cli", "--log-level", args.log_level]
    sched_cmd = [*base, "scheduler", "--model", args.model, *_forward(scheduler.add_args, args)]
    connect = args.executor_bind.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")
    args.scheduler_address = connect  # the executor connects where the scheduler binds
    exec_cmd = [*base, "executor", "--model", args.model, *_forward(executor.add_args, args)]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    # On a small CPU, OpenMP threads that spin while waiting steal the cores the other process
    # needs (a decode step takes several times longer); let them sleep instead.
    exec_env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
    # Own process groups: a terminal's Ctrl-C reaches serve alone, which stops them in order.
    # stderr through serve, which keeps each child's last line (the error it died of).
    ready = Path(tempfile.mkdtemp(prefix="pagedserve-serve-"))  # 0700: the engine socket too

    def child(name: str, cmd: list[str], env: dict) -> Supervised:
        return Supervised(name, lambda: subprocess.Popen(
            cmd, env={**env, READY_ENV: str(ready / name)}, stderr=subprocess.PIPE,
            process_group=0), ready_file=ready / name)

    if args.api_server_count == "auto":
        args.api_server_count = _auto_api_servers(args)
    elif args.api_server_count > 1 and args.api_keys:
        _check_quotas_shared(args)
    if args.api_server_count > 0:  # the engine core and its API processes
        engine_at = args.engine_address or f"ipc://{ready / 'engine.sock'}"
        side = [*_forward(scheduler.add_args, args), "--engine-address", engine_at]
        front = [child("engine", [*base, "engine", "--model", args.model, *side], os.environ)]
        front += [child(f"api-{i}", [*base, "api", "--model", args.model, *side], os.environ)
                  for i in range(args.api_server_count)]
    else:
        front = [child("scheduler", sched_cmd, os.environ)]
    execu = child("executor", exec_cmd, exec_env)
    code = 0
    while not stopping:
        time.sleep(0.2)
        if not all(c.check() for c in (*front, execu)):  # restarts spent within their window
            code = 1
            break
    # the API side first (it drains its streams), then the engine core, then the executor
    grace = args.shutdown_delay_s + args.drain_timeout_s + 15
    cores, apis = (front[:1], front[1:]) if args.api_server_count > 0 else ([], front)
    for c in apis:  # all at once: each drains its own streams
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    codes = [_terminate(c.proc, grace, signalled=True) for c in apis]
    codes += [_terminate(c.proc, args.drain_timeout_s + 15) for c in cores]
    codes.append(_terminate(execu.proc, 15))
    shutil.rmtree(ready, ignore_errors=True)
    names = [c.name for c in (*apis, *cores, execu)]
    log.info("%s exited with %s", names[0], ", ".join(  # "scheduler exited with 0, executor
        [str(codes[0]), *(f"{n} with {c}" for n, c in zip(names[1:], codes[1:], strict=True))]))
    return code or (0 if not any(codes) else 1)


def _auto_api_servers(args: argparse.Namespace) -> int:
    """--api-server-count auto: by the usable cores (flags.auto_api_server_count), 1 where
    the API keys carry quotas (each API process would count its own)."""
    from pagedserve.scheduler import flags as scheduler

    cores = scheduler.usable_cores()
    n = scheduler.auto_api_server_count(cores)
    why = f"{cores:g} usable cores"
    if n > 1 and args.api_keys and _quota_tenants(args):
        n, why = 1, f"{why}, and tenants with quotas"
    log.info("--api-server-count auto: %d API process%s (%s)", n, "es" if n > 1 else "", why)
    return n


def _quota_tenants(args: argparse.Namespace) -> list[str]:
    """The tenants of --api-keys with max_concurrent or tokens_per_minute."""
    from pagedserve.scheduler.api.tenants import Tenants, TenantsError

    try:
        tenants = Tenants.from_file(args.api_keys)
    except TenantsError as e:
        raise SystemExit(f"pagedserve serve: {e}") from None
    return [t.name for t in tenants.by_name.values() if t.max_concurrent or t.tokens_per_minute]


def _check_quotas_shared(args: argparse.Namespace) -> None:
    """Tenant quotas are counted by each API process: with two or more, a tenant would get
    each one's share. Refused until the engine core counts them."""
    quota = _quota_tenants(args)
    if quota:
        raise SystemExit(f"pagedserve serve: --api-server-count {args.api_server_count}: the "
                         f"tenants {', '.join(quota)} have max_concurrent or tokens_per_minute, "
                         "which each API process would count on its own; use "
                         "--api-server-count 1 (or 0) with quotas")


def _terminate(proc: subprocess.Popen, timeout: float, signalled: bool = False) -> int:
    """SIGTERM (unless already sent: a second one would end a process that is past its
    handlers), then up to `timeout` for it to exit before SIGKILL; its exit code."""
    if proc.poll() is None and not signalled:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _forward(add_args, args: argparse.Namespace) -> list[str]:
    """The command-line flags that reproduce `args` for one process's own parser."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    flags: list[str] = []
    for action in parser._actions:
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(flag if value else flag.replace("--", "--no-", 1))
        elif isinstance(value, list):
            flags += [flag, *map(str, value)] if value else []
        elif value is not None:  # None: left to the process's own default
            flags += [flag, str(value)]
    return flags


def _tls_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--tls", action="store_true", help="TLS, verified against the system's CAs")
    p.add_argument("--tls-ca", default=env("PAGEDSERVE_TLS_CA"),
                   help="PEM CA to verify the server with (implies --tls) [env PAGEDSERVE_TLS_CA]")
    p.add_argument("--tls-cert", default=env("PAGEDSERVE_TLS_CERT"),
                   help="client certificate for mutual TLS [env PAGEDSERVE_TLS_CERT]")
    p.add_argument("--tls-key", default=env("PAGEDSERVE_TLS_KEY"),
                   help="its private key [env PAGEDSERVE_TLS_KEY]")


def _tls_of(args: argparse.Namespace) -> dict:
    return {"tls": args.tls, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert,
            "tls_key": args.tls_key}


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.client import channel as open_channel
    from pagedserve.core.wire import HEALTH_LIVENESS, HEALTH_READINESS

    service = HEALTH_READINESS if args.readiness else HEALTH_LIVENESS
    request = health_pb2.HealthCheckRequest(service=service)
    with open_channel(args.address, **_tls_of(args)) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        except grpc.RpcError as e:
            print(_rpc_error(args.address, e), file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from pagedserve.client import Client

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        chat = ([("system", args.system)] if args.system else []) + [("user", prompt)]
        source = {"chat": chat}
    else:
        source = {"text": prompt}
    wrote = False
    with Client(args.address, args.api_key, **_tls_of(args)) as client:
        try:
            for chunk in client.generate(
                **source, max_tokens=args.max_tokens, temperature=args.temperature,
                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                ignore_eos=args.ignore_eos, priority=args.priority, timeout=args.timeout,
            ):
                if args.json:
                    from google.protobuf.json_format import MessageToDict

                    print(json.dumps(MessageToDict(chunk)), flush=True)
                else:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                wrote = True
        except grpc.RpcError as e:
            if wrote and not args.json:
                sys.stdout.write("\n")  # the error starts its own line after the partial text
            print(_rpc_error(args.address, e), file=sys.stderr)
            return 1
    if not args.json:
        sys.stdout.write("\n")
    return 0


def _rpc_error(address: str, e) -> str:
    """One line for a failed call; a server that is not there gets a hint instead of gRPC's
    list of addresses tried (the call does not wait for a connection, so this is immediate)."""
    code, details = e.code().name, " ".join((e.details() or "").split())
    if code == "UNAVAILABLE" and "Connection refused" in details:
        return (f"pagedserve: error: no server is running at {address} (connection refused); "
                f"start one with `pagedserve serve`, or give --address of a running one")
    if code == "UNAVAILABLE" and "failed to connect to all addresses" in details:
        # something answers but the connection fails: e.g. a TLS server asked in plain text
        return (f"pagedserve: error: cannot connect to {address} (is it a TLS server? then "
                f"give --tls or --tls-ca): {details}")
    if code == "UNAVAILABLE" and ("DNS resolution failed" in details
                                  or "errors resolving" in details):
        return f"pagedserve: error: cannot resolve the host of {address}"
    return f"pagedserve: error: {code}: {details}"


def entry() -> None:
    """The command line's entry point: main(), then an exit that skips the interpreter's
    teardown once the command has returned (its work done, its output flushed). Tearing
    down a serving process collects every object torch, transformers and a tokenizer made
    (all of them: the frozen ones are handed back, pagedserve.core.collector), 1-2 s a
    process; `serve` stops its processes one after another, so an idle replica took 6.4 s
    to exit on 2 cores, and a rolling restart waits for that."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
