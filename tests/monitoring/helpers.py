"""Scrape helpers: render a registry/collector to the text format and parse it back."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


def scrape(*collectors: Collector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    return generate_latest(registry).decode()


def parse(text: str) -> dict[str, list]:
    """``{sample name: [Sample, ...]}`` of an exposition text (parsed with prometheus_client's parser)."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    hits = [s for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples in {samples.get(name)}"
    return hits[0].value
