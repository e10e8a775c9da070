"""How much of the device a long prompt's prefill may take while other requests decode
(`--long-prefill-decode-share`, docs/performance.md#long-context).

A chunk of a long prompt at depth c attends to c keys per token: at 128k a 512-token chunk
costs the 8B ~100 ms, and every decoder in that step waits for it. No chunk size fixes that
(a chunk of a few tokens still reads the whole prompt's KV), so the share bounds time instead:
while requests decode, a partial prefill's next chunk (the first chunk of a prompt is never
held, so a short request's first token waits for at most one chunk) goes into a step only
while the time the chunked steps took beyond a plain decode step is repaid by `share` times
the decode steps since. Over the prefill a decoder's steps then average at most (1 + share)
plain ones: TPOT within 1.5x at share 0.5, and the prompt's prefill takes about 1 / share
times its device time longer. Without decoders nothing is held, nor is a prompt more
important (a lower priority number) than every decoder.

Times are measured, not modelled: the interval from one step's result to the next (from the
step's send if the loop was idle), which is what a decoder sees between its tokens. A plain
decode step's time is a moving average of the steps that had decoders and no partial
prefill, each counted at most OUTLIER times the average: one stalled step (a kernel compiled
on first use, a collection) would otherwise raise the average past the chunked steps' own
times, so that they seemed to cost nothing beyond it and went in every step (on an H100,
a 2 s stall at a 128k prompt's start let its chunks take every step for the rest of its
prefill: the decoders' TPOT p50 7.0 -> 59 ms).

Within a stretch of held prefill (from its first chunk beside decoders to the first step
that neither carries nor holds one) every step is measured against the plain step's time at
its start (`ref`, frozen), and each allows (1 + share) of it: a chunked step is charged what
it took beyond ref, and so are the steps behind it and the held ones, each earning share x
ref. On an H100 at 8B, 64 decoders and a 128k prompt, the plain steps took 8.9 ms inside
the stretch against 7.3 before it, and the steps right behind a chunk 10.7: an average kept
inside the stretch followed them, and the decoders saw 1.5-1.9x at shares 0.4 and 0.5. A
held step still earns at least FLOOR of its share, so that a stretch in which plain steps
grew for reasons of their own (more decoders) ends. At most one chunk is in flight: with a
step planned before the previous result is in, a second chunk went in on credit the first
had not been charged yet (`reserve`, until its result or RESERVE_RESULTS results). Each
stretch logs what its steps took.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

DECODE_EMA = 0.2  # weight of the newest plain step in the average
OUTLIER = 2.0  # a plain step counts at most this many times the average (or ref)
AFTER = 2  # results after a chunked one: "after a chunk" in the log (steps in flight: 2)
RESERVE_RESULTS = 3  # a planned chunk's reservation lapses after this many results
FLOOR = 0.25  # a held step earns at least this part of share x ref

log = logging.getLogger("pagedserve.scheduler")


@dataclass(slots=True)
class PrefillShare:
    share: float  # > 0
    credit: float = 0.0  # seconds; a chunk goes in while it is >= 0
    decode_s: float = 0.0  # a plain decode step's time outside stretches (0: none seen yet)
    ref: float = 0.0  # within a stretch: decode_s at its start (0: none, or not known then)
    after: int = 0  # results still to count as behind the last chunked step
    reserved: int = 0  # a chunk is planned and not observed: results until that lapses
    # this stretch's steps: kind -> [steps, seconds] (logged when it ends)
    tally: dict[str, list[float]] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return self.credit >= 0.0 and not self.reserved

    def reserve(self) -> None:
        """A chunk was planned: no other goes in until its result is observed."""
        self.reserved = RESERVE_RESULTS

    def observe(self, seconds: float, *, decoding: bool, chunked: bool, held: bool) -> None:
        """A step's result: it took `seconds`, had decode rows (`decoding`), a partial
        prefill's chunk (`chunked`), or held one back (`held`)."""
        self.reserved = 0 if chunked else max(self.reserved - 1, 0)
        if not decoding:
            self.credit, self.after = 0.0, 0  # nobody decoded: nothing to repay
            self._end()
            return
        if chunked:
            kind, self.after = "chunked", AFTER
        elif self.after:
            kind, self.after = "after a chunk", self.after - 1
        elif held:
            kind = "held"
        else:  # a plain step, no stretch (or its end)
            self._end()
            self._average(seconds)
            return
        if not self.tally:  # a stretch starts
            self.ref = self.decode_s
        self._count(kind, seconds)
        ref = self.ref
        if not ref:  # no plain step known: a chunk counts whole, the first plain one sets ref
            if chunked:
                self.credit -= seconds
            elif kind == "held":
                self._average(seconds)
                self.ref = self.decode_s
            return
        took = seconds if chunked else min(seconds, OUTLIER * ref)
        earned = self.share * ref - (took - ref)
        if kind == "held":
            earned = max(earned, FLOOR * self.share * ref)
        self.credit = min(self.credit + earned, 0.0)  # never banked: a later prompt starts even

    def _average(self, seconds: float) -> None:
        if self.decode_s:
            self.decode_s += DECODE_EMA * (min(seconds, OUTLIER * self.decode_s) - self.decode_s)
        else:
            self.decode_s = seconds

    def _count(self, kind: str, seconds: float) -> None:
        t = self.tally.setdefault(kind, [0, 0.0])
        t[0] += 1
        t[1] += seconds

    def _end(self) -> None:
        """A stretch of held prefill is over: what its steps took, beside its reference."""
        if self.tally.get("chunked"):
            log.info("prefill share %.2f: %s; the plain step before it %.2f ms", self.share,
                     ", ".join(f"{int(n)} steps {kind} {s:.2f} s ({1e3 * s / n:.1f} ms each)"
                               for kind, (n, s) in self.tally.items()), 1e3 * self.ref)
        self.tally.clear()
        self.ref = 0.0
