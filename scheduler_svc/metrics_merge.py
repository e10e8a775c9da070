"""One /metrics for an engine core and its API processes: the engine's own registry with the
API processes' families (metrics.API_FAMILIES, sent in their hellos as Prometheus text) added
in, sample by sample, under the same names and labels. Counters and histograms only, so a sum
is right; an API process that is gone keeps its last counts (a counter never goes down)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class MergedRegistry:
    """What /metrics serves (anything with collect(), as prometheus_client's exposition reads
    a registry): `registry`'s families, each sample plus the same sample of every text that
    `texts()` gives."""

    def __init__(self, registry, texts: Callable[[], Iterable[bytes]],
                 families: frozenset[str] | None = None) -> None:
        """families: the only family names taken from the texts (None: every counter and
        histogram)."""
        self.registry, self.texts, self.families = registry, texts, families

    def collect(self) -> list[Metric]:
        added: dict[tuple[str, tuple], float] = {}
        for text in self.texts():
            try:
                families = list(text_string_to_metric_families(text.decode()))
            except Exception:  # noqa: BLE001 (a peer's bad text must not break the scrape)
                continue
            for family in families:
                if family.type not in ("counter", "histogram") or (
                        self.families is not None and family.name not in self.families):
                    continue
                for s in family.samples:
                    if s.name.endswith("_bucket") and "le" not in s.labels:
                        continue
                    key = (s.name, tuple(sorted(s.labels.items())))
                    added[key] = added.get(key, 0.0) + s.value
        out = []
        for family in self.registry.collect():
            if not added:
                out.append(family)
                continue
            merged = Metric(family.name, family.documentation, family.type, family.unit)
            seen = set()
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                seen.add(key)
                merged.samples.append(Sample(s.name, s.labels, s.value + added.get(key, 0.0),
                                             s.timestamp, s.exemplar))
            for key, value in added.items():  # label values only the API processes have
                name, labels = key
                if key not in seen and _belongs(name, family):
                    merged.samples.append(Sample(name, dict(labels), value))
            out.append(merged)
        return out


def _belongs(sample: str, family: Metric) -> bool:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return any(sample == family.name + s for s in suffixes.get(family.type, ()))
