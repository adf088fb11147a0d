"""The one reader of a server's ``GET /metrics`` page (Prometheus text exposition format 0.0.4).

The page is parsed with ``prometheus_client.parser`` (the reference parser of the format); every
sample is kept with its labels and its family, because the servers vlite reads put facts in
labels (vLLM's ``vllm:cache_config_info`` carries ``block_size`` and ``num_gpu_blocks`` as
labels) and export one series per engine or per API-server process (the ``engine`` label).
"""

from __future__ import annotations

from dataclasses import dataclass

# Labels that split one series into its buckets or quantiles, not into series of their own.
PART_LABELS = frozenset({"le", "quantile"})


class MetricsFormatError(ValueError):
    """The page is not Prometheus text (the message names the first bad line, or quotes the
    start of the page), or holds no sample where one is required."""


@dataclass(frozen=True)
class Sample:
    """One sample line: series name (with its ``_total``/``_bucket`` suffix), labels, value, and
    the family it belongs to (as ``# TYPE`` declares it: ``vllm:request_success`` for the
    sample ``vllm:request_success_total``)."""

    name: str
    labels: dict
    value: float
    family: str = ""


FamilyCounts = dict[str, tuple[int, dict[str, int]]]  # family -> (series, label -> distinct values)


class MetricsPage:
    """All samples of one scrape, looked up by series name.

    Args:
        samples: the parsed samples, in page order.
        families: every family the page declares, in page order, with or without samples
            (default: those of ``samples``).
    """

    def __init__(self, samples: list[Sample], families: list[str] | None = None) -> None:
        self.samples = samples
        self.families = families if families is not None else list(dict.fromkeys(s.family for s in samples))
        self._by_name: dict[str, list[Sample]] = {}
        for s in samples:
            self._by_name.setdefault(s.name, []).append(s)

    @property
    def names(self) -> set[str]:
        """Every series name on the page."""
        return set(self._by_name)

    def has(self, name: str) -> bool:
        """Whether the page holds a sample named ``name``."""
        return name in self._by_name

    def series(self, name: str) -> list[Sample]:
        """Every sample of ``name`` (one per label set), or []."""
        return self._by_name.get(name, [])

    def total(self, name: str) -> float | None:
        """The sum over every label set of ``name`` (e.g. over vLLM's ``engine`` label), or None if absent."""
        s = self.series(name)
        return sum(x.value for x in s) if s else None

    def first(self, name: str) -> float | None:
        """The value of the first sample of ``name`` on the page, or None if absent."""
        s = self.series(name)
        return s[0].value if s else None

    def labels(self, name: str) -> dict:
        """The labels of the first sample of ``name`` (an ``*_info`` gauge), or {}."""
        s = self.series(name)
        return dict(s[0].labels) if s else {}

    def first_values(self) -> dict[str, float]:
        """``{series name: value of its first sample}`` (a gauge's value where it has one label set)."""
        return {name: s[0].value for name, s in self._by_name.items()}

    def histogram_buckets(self, family: str) -> dict[float, float]:
        """Cumulative bucket counts by upper bound ``le`` (+Inf as ``math.inf``) of histogram
        ``family``, summed over its label sets; {} when the page has no such histogram."""
        out: dict[float, float] = {}
        for s in self.series(f"{family}_bucket"):
            if s.family == family and "le" in s.labels:
                le = float(s.labels["le"].replace("+Inf", "inf"))
                out[le] = out.get(le, 0.0) + s.value
        return out

    def series_counts(self) -> FamilyCounts:
        """Per metric family (as ``# TYPE`` declares it): its number of series (distinct label
        sets; a histogram's ``le`` and a summary's ``quantile`` are parts of one series) and each
        label's number of distinct values; a family declared without samples has 0 series."""
        series: dict[str, set[tuple]] = {f: set() for f in self.families}
        values: dict[str, dict[str, set[str]]] = {f: {} for f in self.families}
        for s in self.samples:
            labels = {k: v for k, v in s.labels.items() if k not in PART_LABELS}
            series[s.family].add(tuple(sorted(labels.items())))
            fam_values = values[s.family]
            for k, v in labels.items():
                fam_values.setdefault(k, set()).add(v)
        return {name: (len(series[name]), {k: len(v) for k, v in values[name].items()}) for name in series}

    def labelled_values(self, prefix: str = "vlite:", label: str = "finished_reason") -> dict[str, float]:
        """The samples of the series starting with ``prefix`` as ``{name: value}``, or
        ``{name{<label value>}: value}`` for a sample carrying ``label`` (other labels dropped;
        of samples that then share a key, the last on the page wins)."""
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name.startswith(prefix):
                out[f"{s.name}{{{s.labels[label]}}}" if label in s.labels else s.name] = s.value
        return out


def parse_page(text: str, *, allow_empty: bool = False) -> MetricsPage:
    """Parse a ``/metrics`` body into a ``MetricsPage``.

    ``allow_empty``: an empty or comments-only page gives an empty ``MetricsPage`` instead of
    an error. Comment lines (``# HELP``, ``# TYPE``, ``# EOF``) carry no sample; a sample's
    timestamp is dropped.

    Raises:
        MetricsFormatError: the body is not Prometheus text (the message names the first line
            that does not parse), or (unless ``allow_empty``) holds no sample at all.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: list[Sample] = []
    families: dict[str, None] = {}  # the parser may split one family in several (samples out of order): merged by name
    try:
        for fam in text_string_to_metric_families(text):
            families[fam.name] = None
            for s in fam.samples:
                samples.append(Sample(s.name, dict(s.labels), float(s.value), fam.name))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsFormatError(_where(text)) from exc
    if not samples and not allow_empty:
        raise MetricsFormatError("the page holds no metric sample (empty or comments only)")
    return MetricsPage(samples, list(families))


def _where(text: str) -> str:
    """Why a page that failed to parse is not Prometheus text: its first line that fails on its
    own, or (an error that needs the lines around it) the start of the page."""
    from prometheus_client.parser import text_string_to_metric_families

    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            list(text_string_to_metric_families(line + "\n"))
        except (ValueError, TypeError, IndexError):
            return f"not Prometheus text: line {lineno} does not parse: {line.strip()[:80]!r}"
    head = " ".join(text.strip().split())[:48]
    return f"not Prometheus text; the page starts with {head!r}"


def labelled_values(text: str, prefix: str = "vlite:", label: str = "finished_reason") -> dict[str, float]:
    """``MetricsPage.labelled_values`` of a ``/metrics`` body.

    Raises:
        MetricsFormatError: the body is not Prometheus text, or holds no sample at all.
    """
    return parse_page(text).labelled_values(prefix, label)
