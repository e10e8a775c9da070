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

Each stretch of held prefill (from its first chunked step beside decoders to the first step
that neither carries nor holds a chunk) logs what its steps took by kind: chunked, the AFTER
results behind a chunk, held. On an H100 (8B, 64 decoders, a 128k prompt; logged under the
two accountings below) the held plain steps took 8.9-10.4 ms where the decoders had seen
7.3 ms a token before the prompt came, which this accounting cannot repay: it measures
chunks against the plain steps it sees. Two accountings that charged that too (the steps
behind a chunk and one chunk in flight; then every step against the plain step's time
frozen at the stretch's start) measured worse on that GPU (TPOT p99 x1.66-1.86 against this
one's x1.48-1.54) and were taken back (docs/performance.md#long-context).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

DECODE_EMA = 0.2  # weight of the newest plain step in the average
OUTLIER = 2.0  # a plain step counts at most this many times the average
AFTER = 2  # results behind a chunked one, logged as "after a chunk" (steps in flight: 2)

log = logging.getLogger("pagedserve.scheduler")


@dataclass(slots=True)
class PrefillShare:
    share: float  # > 0
    credit: float = 0.0  # seconds; a chunk goes in while it is >= 0
    decode_s: float = 0.0  # a plain decode step's time (0: none seen yet)
    after: int = 0  # results still to log as behind the last chunked step
    # this stretch's steps: kind -> [steps, seconds] (logged when it ends)
    tally: dict[str, list[float]] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return self.credit >= 0.0

    def observe(self, seconds: float, *, decoding: bool, chunked: bool, held: bool) -> None:
        """A step's result: it took `seconds`, had decode rows (`decoding`), a partial
        prefill's chunk (`chunked`), or held one back (`held`)."""
        if not decoding:
            self.credit = 0.0  # nobody decoded: nothing to repay
            self._end()
            return
        if chunked:
            self._count("chunked", seconds)
            self.after = AFTER
            # a step of unknown plain cost counts whole (the next plain step sets it)
            self.credit -= max(seconds - self.decode_s, 0.0) if self.decode_s else seconds
            return
        if self.after:
            self.after -= 1
            self._count("after a chunk", seconds)
        elif held:
            self._count("held", seconds)
        else:
            self._end()
        if self.decode_s:
            seconds = min(seconds, OUTLIER * self.decode_s)
            self.decode_s = (1 - DECODE_EMA) * self.decode_s + DECODE_EMA * seconds
        else:
            self.decode_s = seconds
        if held:  # repaying: never banked past zero, so a later prompt starts even
            self.credit = min(self.credit + self.share * seconds, 0.0)

    def _count(self, kind: str, seconds: float) -> None:
        t = self.tally.setdefault(kind, [0, 0.0])
        t[0] += 1
        t[1] += seconds

    def _end(self) -> None:
        """A stretch of held prefill is over: what its steps took, beside a plain step's."""
        if self.tally.get("chunked"):
            log.info("prefill share %.2f: %s; a plain step %.2f ms", self.share, ", ".join(
                f"{int(n)} steps {kind} {s:.2f} s ({1e3 * s / n:.1f} ms each)"
                for kind, (n, s) in self.tally.items()), 1e3 * self.decode_s)
        self.tally.clear()
        self.after = 0
