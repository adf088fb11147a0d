"""Parsing a server's ``GET /metrics`` page (Prometheus text exposition format 0.0.4).

The page is parsed with ``prometheus_client.parser`` (the reference parser of the format); every
sample is kept with its labels, because the servers vlite reads put facts in labels (vLLM's
``vllm:cache_config_info`` carries ``block_size`` and ``num_gpu_blocks`` as labels) and export
one series per engine or per API-server process (the ``engine`` label).
"""

from __future__ import annotations

from dataclasses import dataclass


class MetricsFormatError(ValueError):
    """The page is not Prometheus text (the message quotes the start of the page)."""


@dataclass(frozen=True)
class Sample:
    """One sample line: series name (with its ``_total``/``_bucket`` suffix), labels, value."""

    name: str
    labels: dict
    value: float


class MetricsPage:
    """All samples of one scrape, looked up by series name.

    Args:
        samples: the parsed samples, in page order.
    """

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self._by_name: dict[str, list[Sample]] = {}
        for s in samples:
            self._by_name.setdefault(s.name, []).append(s)

    @property
    def names(self) -> set[str]:
        """Every series name on the page."""
        return set(self._by_name)

    def has(self, name: str) -> bool:
        return name in self._by_name

    def series(self, name: str) -> list[Sample]:
        """Every sample of ``name`` (one per label set), or []."""
        return self._by_name.get(name, [])

    def total(self, name: str) -> float | None:
        """The sum over every label set of ``name`` (e.g. over vLLM's ``engine`` label), or None if absent."""
        s = self.series(name)
        return sum(x.value for x in s) if s else None

    def first(self, name: str) -> float | None:
        s = self.series(name)
        return s[0].value if s else None

    def labels(self, name: str) -> dict:
        """The labels of the first sample of ``name`` (an ``*_info`` gauge), or {}."""
        s = self.series(name)
        return dict(s[0].labels) if s else {}


def parse_page(text: str) -> MetricsPage:
    """Parse a ``/metrics`` body.

    Raises:
        MetricsFormatError: the body is not Prometheus text, or holds no sample at all.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: list[Sample] = []
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples.append(Sample(s.name, dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError) as exc:
        head = " ".join(text.strip().split())[:48]
        raise MetricsFormatError(f"not Prometheus text; the page starts with {head!r}") from exc
    if not samples:
        raise MetricsFormatError("the page holds no metric sample (empty or comments only)")
    return MetricsPage(samples)


def labelled_values(text: str, prefix: str = "vlite:", label: str = "finished_reason") -> dict[str, float]:
    """The samples of the series starting with ``prefix`` as ``{name: value}``, or
    ``{name{<label value>}: value}`` for a sample carrying ``label`` (other labels dropped; of
    samples that then share a key, the last on the page wins).

    Raises:
        MetricsFormatError: the body is not Prometheus text, or holds no sample at all.
    """
    out: dict[str, float] = {}
    for s in parse_page(text).samples:
        if s.name.startswith(prefix):
            out[f"{s.name}{{{s.labels[label]}}}" if label in s.labels else s.name] = s.value
    return out
