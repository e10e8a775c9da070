"""One configuration for both processes: flag > environment > config file > default.

A key is a flag's dest name (`--max-num-seqs` -> `max_num_seqs`); the flags take vLLM's knob
names where vLLM has one (gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
max_model_len, block_size, enforce_eager, quantization, enable_prefix_caching), and vLLM's
`swap_space` is accepted for our `swap_space_gib`. The environment variable of a key is
`PAGEDSERVE_` + the key in upper case. The file (`--config path` or `PAGEDSERVE_CONFIG`) is
YAML, the format of docker-compose and of vLLM's own `--config`, so one file can be shared; one
file serves both processes, so each accepts the other's keys and ignores them.

The sources are folded into each argparse action's default, so argparse keeps the last word
(an explicit flag) and `--help` shows the value that applies.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "PAGEDSERVE_"
ALIASES = {"swap_space": "swap_space_gib"}  # other names -> our dest
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A config file or environment variable that cannot be used; the message names it."""


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def config_path(argv: list[str], environ: Mapping[str, str]) -> str | None:
    """The --config argument wherever it appears in argv, else PAGEDSERVE_CONFIG."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    return known.config or environ.get(env_name("config")) or None


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping of keys to values; `-` in keys reads as `_`, aliases resolved."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys to values")
    return normalize(data)


def normalize(values: Mapping[Any, Any]) -> dict[str, Any]:
    """Keys as dest names: `-` read as `_`, aliases resolved."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        out[ALIASES.get(dest, dest)] = value
    return out


def check_keys(values: Mapping[str, Any], known: Iterable[str], source: str) -> None:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{source}: unknown keys {', '.join(unknown)}")


def apply(parser: argparse.ArgumentParser, file_values: Mapping[str, Any],
          environ: Mapping[str, str], source: str = "config file") -> None:
    """Fold the file's and the environment's values into the defaults of parser's flags and
    name each flag's environment variable in its help."""
    aliases = {dest: alias for alias, dest in ALIASES.items()}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        dest = action.dest
        value = action.default
        if dest in file_values:
            value = _convert(action, file_values[dest], f"{source}: {dest}")
        for name in (aliases.get(dest), dest):  # the canonical name wins
            if name and env_name(name) in environ:
                value = _convert(action, environ[env_name(name)], env_name(name))
        action.default = value
        if action.help and "PAGEDSERVE_" not in action.help:
            action.help += f" [env {env_name(dest)}]"


def _convert(action: argparse.Action, raw: Any, where: str) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {raw!r}")
    convert = action.type if callable(action.type) else str
    if action.nargs in ("*", "+"):  # a YAML list, or words separated by spaces
        items = raw if isinstance(raw, list | tuple) else str(raw).split()
        return [_convert_one(action, convert, item, where) for item in items]
    return _convert_one(action, convert, raw, where)


def _convert_one(action: argparse.Action, convert: Any, raw: Any, where: str) -> Any:
    try:
        value = convert(str(raw))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: must be one of {', '.join(map(str, action.choices))}, "
                          f"got {value!r}")
    return value


GiB = 1 << 30
CPU_STEP_BOUNDS = (128, 2048)  # (max_num_seqs, max_num_batched_tokens): a CPU step is slow


def step_bounds(device_type: str, total_memory: int = 0, device_name: str = "") -> tuple[int, int]:
    """Default (max_num_seqs, max_num_batched_tokens) for a device, vLLM's rule for its API
    server (EngineArgs.get_batch_defaults): cards of at least 70 GiB other than the A100
    (H100, H200, MI300X) 1024 and 8192; other cards 256 and 2048 (a larger token budget made
    the A100 slower in vLLM's measurements, vLLM PR #17885). The CPU keeps small steps."""
    if device_type != "cuda":
        return CPU_STEP_BOUNDS
    if total_memory >= 70 * GiB and "a100" not in device_name.lower():
        return 1024, 8192
    return 256, 2048


def add_step_args(p: argparse.ArgumentParser) -> None:
    """Step bounds, shared by both processes: the scheduler plans steps within them, the
    executor profiles its memory and captures its decode CUDA graphs for them. 0 (the
    default): the executor's device decides (step_bounds) and the scheduler takes its values."""
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="most requests in one step (0: by device: 1024 on CUDA cards of >= 70 "
                        "GiB but the A100, 256 on other cards, 128 on the CPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="token budget of one step, prefill chunks + decodes (0: by device: "
                        "8192 on CUDA cards of >= 70 GiB but the A100, 2048 otherwise)")


def add_insecure_link_arg(p: argparse.ArgumentParser) -> None:
    """Shared by both processes (one flag under `serve`): an executor link other hosts can
    reach, without keys, is refused unless this is given."""
    p.add_argument("--insecure-executor-link", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="allow an executor link that other hosts can reach without keys "
                        "(prompts cross the network in plain text)")


def add_speculative_arg(p: argparse.ArgumentParser) -> None:
    """Shared by both processes (one flag under `serve`): the scheduler plans the drafts; with
    method draft_model, eagle or eagle3 the executor loads the draft model or head and
    proposes them (pagedserve.core.speculative)."""
    p.add_argument("--speculative-config", default="",
                   help="speculative decoding, vLLM's JSON: e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5, "
                        "\"prompt_lookup_min\": 2, \"num_speculative_tokens_per_batch_size\": "
                        "[[17, 1024, 0]]}', or '{\"method\": \"draft_model\", \"model\": "
                        "DIR, \"num_speculative_tokens\": 4}' (or method eagle / eagle3 "
                        "with an EAGLE head's DIR; empty: off; "
                        "docs/speculative_decoding.md)")


def add_link_timeout_arg(p: argparse.ArgumentParser) -> None:
    """Shared by both processes (one flag under `serve`): ZeroMQ heartbeats on the executor
    link (pagedserve.core.link_liveness)."""
    p.add_argument("--executor-link-timeout-s", type=float, default=2.0,
                   help="the executor link is dropped when the other process has sent "
                        "nothing for this long, not even ZeroMQ's heartbeats (one every "
                        "quarter of it, answered during steps too): a paused, hung or cut-off "
                        "executor is lost within about 1.25 times this (0: no heartbeats)")
