"""LoRA serving's flags, shared by both processes (one set under `serve`): the executor loads the
adapters and holds --max-loras of them in device slots; the scheduler knows their names (API
`model` / `adapter` fields, prefix-cache keys) and decides which slot holds which adapter."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
MAX_RANK = 128  # the kernels hold a slot's rank in one tile (kernels/lora_reference.py)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    modules: tuple[tuple[str, str], ...]  # (name, PEFT directory), adapter id i + 1 is modules[i]
    max_loras: int  # device slots
    max_lora_rank: int  # the largest rank a slot takes
    max_cpu_loras: int = 0  # adapters kept in host memory (0: every one)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.modules)

    def adapter_id(self, name: str) -> int:
        """1-based id of an adapter by name; 0 for the base model ("")."""
        return self.names.index(name) + 1 if name else 0


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
                   help="serve LoRA adapters (--lora-modules) beside the base model, mixed in "
                        "one batch (docs/lora.md)")
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories: adapter_config.json and "
                        "adapter_model.safetensors); a request selects one by NAME (OpenAI "
                        "`model`, gRPC `adapter`); in YAML a list, in the environment "
                        "separated by spaces")
    p.add_argument("--max-loras", type=int, default=1,
                   help="adapters held on the device at once (each a slot; one step runs "
                        "requests of at most this many adapters)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest adapter rank (each slot's size)")
    p.add_argument("--max-cpu-loras", type=int, default=0,
                   help="adapters kept in host memory, least recently used let go (read again "
                        "from their directory when a slot needs one); at least --max-loras "
                        "(0: every adapter)")


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """The flags' LoRA configuration, None when LoRA is off; ValueError (one line) when the
    flags contradict each other."""
    modules = tuple(parse_module(entry) for entry in args.lora_modules or ())
    if not args.enable_lora:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    names = [name for name, _ in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules: {', '.join(twice)} named more than once")
    if args.max_loras < 1:
        raise ValueError(f"--max-loras must be at least 1, got {args.max_loras}")
    if not 1 <= args.max_lora_rank <= MAX_RANK:
        raise ValueError(f"--max-lora-rank must be 1..{MAX_RANK}, got {args.max_lora_rank}")
    if args.max_cpu_loras and args.max_cpu_loras < args.max_loras:
        raise ValueError(f"--max-cpu-loras {args.max_cpu_loras} is less than --max-loras "
                         f"{args.max_loras}")
    return LoraConfig(modules, args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def parse_module(entry: str) -> tuple[str, str]:
    name, sep, path = entry.partition("=")
    if not sep or not path:
        raise ValueError(f"--lora-modules: expected NAME=PATH, got {entry!r}")
    if not _NAME.fullmatch(name):
        raise ValueError(f"--lora-modules: {name!r} is not a valid adapter name (letters, "
                         "digits and ._:/@+- , starting with a letter or digit)")
    return name, path
