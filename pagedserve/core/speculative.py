"""--speculative-config: vLLM's JSON keys, parsed and checked once for both processes (the
scheduler plans drafts; with a draft model or an EAGLE head the executor loads it and proposes).
docs/speculative_decoding.md has what each key does."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
IN_EXECUTOR = ("draft_model", "eagle", "eagle3")  # methods whose drafts the executor proposes
DEFAULT_LOOKUP = (2, 5)  # (prompt_lookup_min, prompt_lookup_max) when neither is given
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
        "draft_tensor_parallel_size", "num_speculative_tokens_per_batch_size")


class SpeculativeConfigError(ValueError):
    """--speculative-config is malformed or asks for what cannot run; the message says why."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP[0]
    prompt_lookup_max: int = DEFAULT_LOOKUP[1]
    # (first, last, k): with first <= running <= last requests, k drafts each (0: none)
    per_batch_size: tuple[tuple[int, int, int], ...] = ()
    model: str = ""  # draft_model: the draft's directory, .gguf file or "default"; eagle,
    # eagle3: the head's directory
    source: dict = field(default_factory=dict, compare=False)  # the JSON as given

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The flag's JSON (an object); None for "" (speculation off)."""
        if not text or not text.strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config: a JSON object is needed")
        return cls.of(raw)

    @classmethod
    def of(cls, raw: dict) -> SpeculativeConfig:
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown key {unknown[0]!r} "
                                         f"(known: {', '.join(KEYS)})")
        method = raw.get("method", "ngram" if "model" not in raw else "draft_model")
        if method not in METHODS:
            raise SpeculativeConfigError(f"--speculative-config: unknown method {method!r} "
                                         f"(one of {', '.join(METHODS)})")
        k = _int(raw, "num_speculative_tokens", None, 1)
        model = raw.get("model") or ""
        if method in IN_EXECUTOR and (not isinstance(model, str) or not model.strip()):
            what = "the draft's directory or .gguf file" if method == "draft_model" else \
                "the EAGLE head's directory"
            raise SpeculativeConfigError(f"--speculative-config: method {method!r} needs "
                                         f"\"model\": {what}")
        if method == "ngram" and model:
            raise SpeculativeConfigError("--speculative-config: method 'ngram' takes no "
                                         "\"model\" (it drafts from the request's own tokens)")
        tp = raw.get("draft_tensor_parallel_size")
        if tp is not None and tp != 1:
            raise SpeculativeConfigError(
                f"--speculative-config: draft_tensor_parallel_size {tp!r}: only 1 is built (the "
                f"draft runs unsharded beside the target)")
        lo = raw.get("prompt_lookup_min")
        hi = raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = DEFAULT_LOOKUP
        lo = _int({"prompt_lookup_min": lo if lo is not None else hi}, "prompt_lookup_min",
                  None, 1)
        hi = _int({"prompt_lookup_max": hi if hi is not None else lo}, "prompt_lookup_max",
                  None, 1)
        if lo > hi:
            raise SpeculativeConfigError(f"--speculative-config: prompt_lookup_min {lo} is "
                                         f"more than prompt_lookup_max {hi}")
        ranges = []
        for item in raw.get("num_speculative_tokens_per_batch_size") or ():
            if (not isinstance(item, list | tuple) or len(item) != 3
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
                    or item[0] < 1 or item[1] < item[0] or not 0 <= item[2] <= k):
                raise SpeculativeConfigError(
                    f"--speculative-config: num_speculative_tokens_per_batch_size: {item!r} "
                    f"is not [first, last, k] with 1 <= first <= last and 0 <= k <= "
                    f"num_speculative_tokens ({k})")
            ranges.append(tuple(item))
        return cls(method, k, lo, hi, tuple(ranges), model, dict(raw))

    def to_json(self) -> str:
        """The config as given (GetModelInfo, /v1/models)."""
        return json.dumps(self.source, sort_keys=True)

    @property
    def drafts_in_executor(self) -> bool:
        """The executor proposes (a draft model, an EAGLE head), rather than the scheduler
        (n-gram)."""
        return self.method in IN_EXECUTOR

    def tokens_for(self, running: int) -> int:
        """Drafts per request in a step of `running` requests."""
        for first, last, k in self.per_batch_size:
            if first <= running <= last:
                return k
        return self.num_speculative_tokens

    def check(self, max_model_len: int, max_num_batched_tokens: int) -> None:
        """Refuse a lookahead the model or the step budget cannot hold."""
        k = self.num_speculative_tokens
        if k + 1 >= max_model_len:
            raise SpeculativeConfigError(f"--speculative-config: num_speculative_tokens {k} "
                                         f"does not fit max_model_len {max_model_len}")
        if k + 1 > max_num_batched_tokens:
            raise SpeculativeConfigError(f"--speculative-config: num_speculative_tokens {k} "
                                         f"does not fit --max-num-batched-tokens "
                                         f"{max_num_batched_tokens} (a drafted request takes "
                                         f"k + 1)")


def _int(raw: dict, key: str, default: int | None, least: int) -> int:
    v = raw.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise SpeculativeConfigError(f"--speculative-config: {key} must be an integer >= "
                                     f"{least}, got {v!r}")
    return v
