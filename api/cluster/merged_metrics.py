"""The replicas' Prometheus metrics as one exposition: per replica, and summed.

Every series a replica exposes appears twice: with a `replica` label (that replica's own),
and without it, summed over the replicas (the series one server exposes, so a dashboard made
for one server reads the whole deployment from the series without the label). Counters,
gauges and histogram buckets, sums and counts are all sums of the replicas' own; the
`_created` timestamps of counters and histograms are left out. `agent_kv_replicas` counts
the replicas reporting.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"


def merge_metrics(texts: dict[str, str]) -> bytes:
    """One exposition (text format) of the metrics of every replica, from each replica's
    own exposition `texts[replica_id]` (see the module).

    Raises:
        ValueError: a text that is not in the exposition format.
    """
    registry = CollectorRegistry()
    registry.register(_Merged(texts))
    return generate_latest(registry)


class _Merged(Collector):
    def __init__(self, texts: dict[str, str]):
        self.families: dict[str, Metric] = {}
        totals: dict[str, dict[tuple, float]] = {}
        for replica_id in sorted(texts):
            for family in text_string_to_metric_families(texts[replica_id]):
                if family.name.endswith("_created"):
                    continue
                merged = self.families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                summed = totals.setdefault(family.name, {})
                for sample in family.samples:
                    labels = {**sample.labels, REPLICA_LABEL: replica_id}
                    merged.add_sample(sample.name, labels, sample.value)
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    summed[key] = summed.get(key, 0.0) + sample.value
        for name, summed in totals.items():
            for (sample_name, labels), value in summed.items():
                self.families[name].add_sample(sample_name, dict(labels), value)
        replicas = Metric("agent_kv_replicas", "Replicas reporting.", "gauge")
        replicas.add_sample("agent_kv_replicas", {}, float(len(texts)))
        self.families["agent_kv_replicas"] = replicas

    def collect(self) -> Iterator[Metric]:
        yield from self.families.values()
