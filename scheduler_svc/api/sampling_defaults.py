"""The model's own sampling defaults (--generation-config): what generation_config.json sets
of temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens apart from
transformers' defaults, used where a request leaves the parameter unset, as vLLM does by
default (`--generation-config auto`; `vllm` ignores the file, as vLLM's value of that name).
Llama 3.1 Instruct's file, for one, sets temperature 0.6 and top_p 0.9; Qwen3's temperature
0.6, top_p 0.95 and top_k 20. A request's own value always wins, in both APIs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

# transformers' GenerationConfig defaults: a value equal to one of these is no default of the
# model's (vLLM takes GenerationConfig.to_diff_dict(), which drops them the same way)
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
               "repetition_penalty": 1.0, "max_new_tokens": None}


class GenerationConfigError(ValueError):
    """A --generation-config that cannot be read."""


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Values for the sampling parameters a request leaves unset; None: the API's own."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                         if getattr(self, f.name) is not None)


def sampling_defaults(value: str, model_dir: Path) -> SamplingDefaults:
    """--generation-config `value`: "auto" (model_dir's generation_config.json), "vllm" (none
    of the model's), or a folder holding a generation_config.json."""
    if value == "vllm":
        return SamplingDefaults()
    folder = model_dir if value == "auto" else Path(value)
    path = folder / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        if value == "auto":
            return SamplingDefaults()
        raise GenerationConfigError(f"--generation-config: no generation_config.json in "
                                    f"{folder}") from None
    except (OSError, ValueError) as e:
        raise GenerationConfigError(f"--generation-config: {path} cannot be read "
                                    f"({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise GenerationConfigError(f"--generation-config: {path} is not a JSON object")
    found = {}
    for key, default in HF_DEFAULTS.items():
        v = config.get(key)
        if v is None or v == default:
            continue
        integral = key in ("top_k", "max_new_tokens")
        if isinstance(v, bool) or not isinstance(v, int if integral else int | float) or (
                not integral and not math.isfinite(v)):
            raise GenerationConfigError(f"--generation-config: {path}: {key} is {v!r}")
        found["max_tokens" if key == "max_new_tokens" else key] = v if integral else float(v)
    return SamplingDefaults(**found)
