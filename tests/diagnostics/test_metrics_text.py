"""The one /metrics reader: every recorded page of vLLM, SGLang, llama.cpp, TGI, TensorRT-LLM, the
routers and vlite parses; escaped label values, ``# EOF``, timestamps and histograms are read as
the format says; a page that is not Prometheus text names its bad line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vlite.diagnostics.readers.metrics_text import MetricsFormatError, parse_page

FIX = Path(__file__).parent / "fixtures"
PAGES = sorted(FIX.glob("*.prom"))


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_every_recorded_page_parses_with_samples_in_their_families(path):
    page = parse_page(path.read_text())
    assert page.samples and set(page.families) >= {s.family for s in page.samples}
    assert all(s.name.startswith(s.family) for s in page.samples)


def test_escaped_label_values_are_unescaped():
    text = ('# TYPE vlite:stop_total counter\n'
            'vlite:stop_total{stop="a\\"b",path="C:\\\\x",nl="x\\ny"} 2\n')
    page = parse_page(text)
    assert page.labels("vlite:stop_total") == {"stop": 'a"b', "path": "C:\\x", "nl": "x\ny"}
    assert page.first("vlite:stop_total") == 2.0 and page.samples[0].family == "vlite:stop"


def test_eof_line_and_timestamps_carry_no_sample():
    page = parse_page("vlite:num_free_blocks 12 1700000000000\n# EOF\n")
    assert [(s.name, s.value) for s in page.samples] == [("vlite:num_free_blocks", 12.0)]


def test_histogram_buckets_are_summed_over_label_sets_and_declared_empty_families_count_zero():
    text = ("# TYPE vlite:itl_seconds histogram\n"
            'vlite:itl_seconds_bucket{engine="0",le="0.1"} 1\n'
            'vlite:itl_seconds_bucket{engine="0",le="+Inf"} 3\n'
            'vlite:itl_seconds_bucket{engine="1",le="0.1"} 2\n'
            'vlite:itl_seconds_bucket{engine="1",le="+Inf"} 2\n'
            'vlite:itl_seconds_sum{engine="0"} 0.5\nvlite:itl_seconds_count{engine="0"} 3\n'
            "# TYPE vlite:idle counter\n")
    page = parse_page(text)
    assert page.histogram_buckets("vlite:itl_seconds") == {0.1: 3.0, math.inf: 5.0}
    assert page.histogram_buckets("vlite:absent") == {}
    assert page.series_counts() == {"vlite:itl_seconds": (2, {"engine": 2}), "vlite:idle": (0, {})}


def test_a_vllm_page_gives_gauges_and_totals_over_engines():
    page = parse_page((FIX / "vllm-0.32.0-cpu-busy.prom").read_text())
    values = page.first_values()
    assert values["vllm:num_requests_running"] == page.first("vllm:num_requests_running")
    assert page.labels("vllm:cache_config_info")["block_size"].isdigit()
    assert page.histogram_buckets("vllm:inter_token_latency_seconds")[math.inf] >= 0


def test_a_malformed_page_names_its_bad_line():
    with pytest.raises(MetricsFormatError, match=r"line 3 does not parse: 'vlite:bad\{x=1\} 2'"):
        parse_page("# TYPE vlite:ok gauge\nvlite:ok 1\nvlite:bad{x=1} 2\n")
    with pytest.raises(MetricsFormatError, match="line 1 does not parse"):
        parse_page((FIX / "not-prometheus.html").read_text())


def test_an_empty_page_is_an_error_unless_allowed():
    with pytest.raises(MetricsFormatError, match="no metric sample"):
        parse_page("# HELP x nothing\n")
    assert parse_page("", allow_empty=True).samples == []
