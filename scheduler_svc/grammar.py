"""Structured outputs on the scheduler side: constraints compiled into grammars (xgrammar), one
matcher per request, and the allowed-token bitmasks of a step.

    request arrives   Grammars.compile(constraint): from the cache, or compiled on a worker
                      thread (xgrammar releases the GIL), so the step loop never waits for it;
                      a bad schema/regex/grammar is InvalidRequest before anything is queued
    submit            Grammars.matcher(compiled): the request's own state (n > 1: one each)
    each step         Grammars.fill(matchers): one bitmask row per constrained request that
                      samples in the step, from its matcher, in one batched call; sent in a
                      StepBitmask message after the plan (the engine's _send_bitmasks)
    each token        the scheduler advances the matcher (Scheduler.update); the request ends
                      when the matcher terminates (the end-of-sequence token after a complete
                      match: the mask allows it only then)

The matcher sees only tokens that came back from the executor: a preempted request (recompute
or swap) or one on a new executor continues from the same matcher state, since its tokens are
the same. docs/structured_outputs.md has the measurements and how the masks travel.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pagedserve.scheduler.invalid import InvalidRequest
from pagedserve.scheduler.request import Constraint

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (LRU); a JSON schema's is tens of KB
MAX_SPEC_CHARS = 64 * 1024  # a schema/regex/grammar longer than this is refused
# xgrammar's messages start with "[time] /path/file.cc:123: ": the client needs only the rest
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class Grammars:
    """Compiles constraints (bounded LRU cache, worker threads) for one tokenizer and
    vocabulary, makes matchers and fills bitmasks."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, threads: int = 2,
                 fill_threads: int = 0) -> None:
        """threads: compile threads; fill_threads: the bitmask fill's (0: half the cores, at
        most 8, as xgrammar's "auto")."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        # the ids xgrammar knows: the tokenizer's. Logit rows past it (an embedding padded
        # beyond the tokenizer) have no text and are never allowed; left to xgrammar as
        # "special" ids they cost every accepted token a pass over them (accept took 4.4 ms
        # a step at 256 rows with 79k of them, 0.7 ms without: the 8B benchmarks pair
        # Llama's 128,256 logits with SmolLM2's 49,152 tokens)
        try:
            self.grammar_vocab = min(vocab_size, len(tokenizer))
        except TypeError:  # a tokenizer that does not say its size (a stand-in): the logits'
            self.grammar_vocab = vocab_size
        self.grammar_words = (self.grammar_vocab + 31) // 32  # int32 words per bitmask row
        self._cache: OrderedDict[Constraint, asyncio.Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._compiler: Any = None
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations run (cache misses)
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, made on first use
        self.fill_threads = fill_threads or max(1, min(8, (os.cpu_count() or 2) // 2))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- compiling
    async def compile(self, c: Constraint) -> Any:
        """The compiled grammar of a constraint; InvalidRequest("sampling.<kind>", "<why>")."""
        fut = self._cache.get(c)
        if fut is None:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._compile, c)
            self._cache[c] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(c)
        try:
            return await asyncio.shield(fut)  # one caller cancelled must not cancel the others
        except InvalidRequest:
            if self._cache.get(c) is fut:
                del self._cache[c]
            raise

    def _compile(self, c: Constraint) -> Any:
        """On a worker thread."""
        import xgrammar as xgr

        compiler = self._get_compiler()
        self.num_compiled += 1
        if len(c.spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"sampling.{c.kind}", f"longer than {MAX_SPEC_CHARS} characters")
        try:
            if c.kind == "json_object":  # any object: properties not listed are allowed
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                    any_whitespace=False)
            if c.kind == "json_schema":
                json.loads(c.spec)  # its own message for text that is not JSON at all
                # compact JSON: with free whitespace a small model can pad forever
                return compiler.compile_json_schema(c.spec, strict_mode=True,
                                                    any_whitespace=False)
            if c.kind == "regex":
                return compiler.compile_regex(c.spec)
            if c.kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(c.spec)))
            if c.kind == "grammar":
                return compiler.compile_grammar(c.spec)
            if c.kind == "lark_grammar":
                return compiler.compile_lark(c.spec)
        except (RuntimeError, ValueError, xgr.InvalidJSONError) as e:
            message = _CPP_PREFIX.sub("", str(e).strip()).strip()
            raise InvalidRequest(f"sampling.{c.kind}", message) from None
        raise InvalidRequest("sampling.constraint", f"unknown kind {c.kind!r}")

    def _get_compiler(self) -> Any:
        import xgrammar as xgr

        with self._lock:  # the first compile builds the vocabulary tables (~0.3 s on 49k)
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.grammar_vocab,
                    stop_token_ids=self.eos_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    # ----------------------------------------------------------------- per request
    def _get_batch(self) -> Any:
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(self.fill_threads)
        return self._batch

    @staticmethod
    def matcher(compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any]) -> np.ndarray:
        """The bitmask rows of these matchers' next tokens, [R, grammar_words] int32 (the
        bytes of StepBitmask's rows, sent as they are: no copy; none may be terminated): as
        wide as the tokenizer's ids, which may end before the logits do (the executor allows
        none past them), so the rows are no wider than xgrammar writes them. One batched
        call: xgrammar spreads the rows over its threads and releases the GIL once, where a
        call per row released and re-took it per row (with another thread of this process
        running, each re-take can wait a GIL switch interval)."""
        import torch

        mask = np.empty((len(matchers), self.grammar_words), np.int32)
        if matchers:  # xgrammar fills a tensor sharing this memory
            self._get_batch().batch_fill_next_token_bitmask(matchers, torch.from_numpy(mask))
        return mask

    @staticmethod
    def accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
        """Advance each matcher by its token in one call (a call per row cost ~34 us each on
        the H200's host at 256 rows); whether each accepted it.

        xgrammar's own wrapper reads the result (a tvm_ffi Array) an element at a time, each
        read a foreign call that drops and re-takes the GIL: 0.18 ms for 256 rows alone, and
        a switch interval (5 ms) per read whenever another thread of the process holds the
        GIL (76 ms a step beside a busy thread, measured on the CPU). Membership tests (one
        call each: is there a 0 or a False) settle the usual case, every token accepted; the
        rows are read one by one only when some token was refused."""
        if not matchers:
            return []
        core, handles = _accept_core(), None
        if core is not None:
            try:
                handles = [m._handle for m in matchers]
            except AttributeError:
                handles = None
        if handles is None:  # another xgrammar layout: its public call
            import xgrammar as xgr

            return list(xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens))
        result = core(handles, tokens, False)
        if 0 not in result and False not in result:  # its elements are ints (0.2.9)
            return [True] * len(matchers)
        return [bool(result[i]) for i in range(len(matchers))]


@functools.cache
def _accept_core() -> Any:
    """xgrammar's batch accept below its Python wrapper, or None where it is not there."""
    try:
        from xgrammar.base import _core
    except ImportError:
        return None
    batch = getattr(_core, "BatchGrammarMatcher", None)
    return getattr(batch, "batch_accept_token", None)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)
