"""vlite bench: metric arithmetic on hand-made timelines, dataset parsing, the grouped CPU decode
attention, and the three commands on a tiny model (``bench serve`` against a real ``vlite serve``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import smollm2_tokenizer
from typer.testing import CliRunner

from vlite.bench import datasets
from vlite.bench.metrics import (
    RequestFuncOutput,
    calculate_metrics,
    format_serving_result,
    itls_from_arrivals,
    percentile_word,
    summarize,
    tpot_of,
)

# ---- metric arithmetic -----------------------------------------------------------------------


def _request(send: float, arrivals: list[float], prompt_len: int = 10, output_tokens: int | None = None):
    ttft, itl = itls_from_arrivals(send, arrivals)
    return RequestFuncOutput(success=True, latency=arrivals[-1] - send, ttft=ttft, itl=itl,
                             output_tokens=len(arrivals) if output_tokens is None else output_tokens,
                             prompt_len=prompt_len)


def test_ttft_itl_tpot_from_a_timeline():
    # sent at t=1.0; tokens at 1.5, 1.6, 1.8, 2.1
    r = _request(1.0, [1.5, 1.6, 1.8, 2.1])
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.latency == pytest.approx(1.1)
    # TPOT = (E2EL - TTFT) / (output_tokens - 1) = (1.1 - 0.5) / 3
    assert tpot_of(r.latency, r.ttft, r.output_tokens) == pytest.approx(0.2)
    assert tpot_of(0.7, 0.7, 1) is None  # a single token has no TPOT
    with pytest.raises(ValueError):
        itls_from_arrivals(0.0, [])


def test_calculate_metrics_aggregates_and_skips_failures():
    a = _request(0.0, [0.2, 0.3, 0.4], prompt_len=5)  # ttft 0.2, e2el 0.4, tpot 0.1
    b = _request(0.0, [0.4, 1.0], prompt_len=7)  # ttft 0.4, e2el 1.0, tpot 0.6
    c = _request(0.0, [0.3], prompt_len=3)  # one token: counted, but no TPOT
    failed = RequestFuncOutput(success=False, prompt_len=100, output_tokens=50, error="HTTP 500")
    m = calculate_metrics([a, b, c, failed], duration_s=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (15, 6)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(10.5)
    assert m.summaries["ttft"]["mean"] == pytest.approx(300.0)  # ms
    assert m.summaries["ttft"]["median"] == pytest.approx(300.0)
    assert m.summaries["tpot"]["mean"] == pytest.approx(350.0)  # (100 + 600) / 2
    assert m.summaries["e2el"]["mean"] == pytest.approx((400 + 1000 + 300) / 3)
    # ITLs pooled over requests: 100, 100, 600 ms
    assert m.summaries["itl"]["mean"] == pytest.approx(800 / 3)
    assert dict(m.percentiles["itl"])[50] == pytest.approx(100.0)
    # numpy's linear interpolation: p99 of [100, 100, 600] = 100 + 0.98 * 500
    assert dict(m.percentiles["itl"])[99] == pytest.approx(590.0)
    with pytest.raises(ValueError):
        calculate_metrics([a], duration_s=0.0, percentiles=[99])


def test_summaries_of_nothing_are_zero_and_percentile_words():
    stats, pcts = summarize([], [50, 99.9])
    assert stats == {"mean": 0.0, "median": 0.0, "std": 0.0}
    assert pcts == [(50, 0.0), (99.9, 0.0)]
    assert (percentile_word(99), percentile_word(99.0), percentile_word(99.9)) == ("99", "99", "99.9")
    stats, pcts = summarize([0.001, 0.002, 0.003, 0.004], [25])
    assert stats["mean"] == pytest.approx(2.5)
    assert stats["std"] == pytest.approx(np.std([1, 2, 3, 4]))
    assert pcts[0][1] == pytest.approx(1.75)


def test_serving_result_block_has_vllm_lines_and_keys():
    m = calculate_metrics([_request(0.0, [0.2, 0.3, 0.4])], 1.0, [99])
    text, keys = format_serving_result(m, 1.0, ["ttft", "tpot", "itl", "e2el"], max_concurrency=4, request_rate=2.0)
    lines = text.splitlines()
    assert lines[0] == "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")
    assert lines[-1] == "=" * 50
    for label in ("Successful requests:", "Failed requests:", "Maximum request concurrency:",
                  "Request rate configured (RPS):", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):",
                  "Mean E2EL (ms):"):
        assert any(line.startswith(label) for line in lines), label
    assert keys["mean_ttft_ms"] == pytest.approx(200.0)
    assert set(keys) == {f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                         for s in ("mean", "median", "std", "p99")}
    text, keys = format_serving_result(m, 1.0, ["ttft"])
    assert "Request rate configured" not in text and "TPOT" not in text and set(keys) == {
        "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms"}


# ---- datasets ----------------------------------------------------------------------------------


def test_random_dataset_lengths_and_determinism():
    tok = smollm2_tokenizer()
    a = datasets.random_requests(tok, 40, (32, 64), (4, 9), seed=3)
    b = datasets.random_requests(tok, 40, (32, 64), (4, 9), seed=3)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(32 <= r.prompt_len <= 64 and 4 <= r.expected_output_len <= 9 for r in a)
    assert {r.expected_output_len for r in a} >= {4, 9}  # inclusive at both ends (40 draws of 6 values)
    special = set(tok.all_special_ids)
    assert not any(t in special for r in a for t in r.prompt_token_ids)
    assert datasets.length_range(100, 0.5) == (50, 150)
    assert datasets.length_range(10, 0.0) == (10, 10)
    with pytest.raises(ValueError):
        datasets.length_range(10, 1.0)
    with pytest.raises(ValueError):
        datasets.random_requests(tok, 2, (10, 5), (1, 1))


def test_sharegpt_parsing(tmp_path):
    tok = smollm2_tokenizer()
    long_answer = "The answer is a long and careful explanation of many things. " * 3
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is a KV cache in a transformer?"},
                                      {"from": "gpt", "value": long_answer}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only one turn here"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Tell me about paged attention, please."},
                                      {"from": "gpt", "value": long_answer},
                                      {"from": "human", "value": "thanks"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = datasets.sharegpt_requests(path, tok, num_prompts=2, seed=0)
    assert sorted(r.prompt for r in reqs) == sorted([data[0]["conversations"][0]["value"],
                                                     data[3]["conversations"][0]["value"]])
    for r in reqs:
        assert r.prompt_token_ids == tok(r.prompt).input_ids
        assert r.expected_output_len == len(tok(long_answer).input_ids)
    fixed = datasets.sharegpt_requests(path, tok, num_prompts=3, output_len=5, seed=0)  # min_len not applied
    assert len(fixed) == 3 and all(r.expected_output_len == 5 for r in fixed)
    with pytest.raises(ValueError, match="only 2 usable"):
        datasets.sharegpt_requests(path, tok, num_prompts=3, seed=0)
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(ValueError):
        datasets.sharegpt_requests(bad, tok, 1)


def test_prefix_repetition_shares_prefixes():
    tok = smollm2_tokenizer()
    reqs = datasets.prefix_repetition_requests(tok, num_prompts=12, prefix_len=20, suffix_len=5, num_prefixes=3,
                                               output_len=7, seed=1)
    assert len(reqs) == 12 and all(r.prompt_len == 25 and r.expected_output_len == 7 for r in reqs)
    prefixes = {tuple(r.prompt_token_ids[:20]) for r in reqs}
    assert len(prefixes) == 3
    assert len({tuple(r.prompt_token_ids[20:]) for r in reqs}) == 12


# ---- the CPU decode attention: length groups give the same result as one padded batch ----------


def test_grouped_decode_attention_matches_one_padded_batch():
    from vlite.kernels import torch_ref
    from vlite.kernels.attention import AttentionMetadata

    torch.manual_seed(0)
    num_blocks, bs, hkv, hq, d = 64, 4, 2, 6, 8
    k_cache, v_cache = torch.randn(num_blocks, bs, hkv, d), torch.randn(num_blocks, bs, hkv, d)
    lens = [3, 40, 17, 38, 5, 9, 22, 40, 1, 12, 30, 25, 7, 33, 2, 16, 29, 11]
    groups = torch_ref.decode_groups(lens, min_group=4)
    assert len(groups) > 1 and sorted(i for g in groups for i in g) == list(range(len(lens)))
    max_blocks = -(-max(lens) // bs)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), hq, d)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long),
                             query_start_loc=torch.arange(len(lens) + 1), seq_lens=torch.tensor(lens),
                             block_tables=tables, num_decodes=len(lens), query_lens=[1] * len(lens),
                             seq_lens_list=lens, block_size=bs)
    out = torch_ref._decode_attention(q, k_cache, v_cache, meta, d ** -0.5)
    for i, n in enumerate(lens):  # reference: each row alone, K/V repeated for GQA
        k = k_cache[tables[i]].flatten(0, 1)[:n].repeat_interleave(hq // hkv, dim=1)
        v = v_cache[tables[i]].flatten(0, 1)[:n].repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i], k) * d ** -0.5, dim=-1)
        torch.testing.assert_close(out[i], torch.einsum("hl,lhd->hd", p, v), rtol=1e-5, atol=1e-5)


# ---- the commands on a tiny model --------------------------------------------------------------


@pytest.fixture(scope="module")
def cli():
    from vlite.cli.main import app

    runner = CliRunner()

    def invoke(*args: str):
        result = runner.invoke(app, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    return invoke


def test_bench_throughput_with_hf_baselines(cli, tiny_model_dir, tmp_path):
    out_json = tmp_path / "t.json"
    text = cli("bench", "throughput", "--model", str(tiny_model_dir), "--num-prompts", "5", "--input-len-range",
               "8:40", "--output-len-range", "2:10", "--backend", "hf", "--num-blocks", "64", "--no-progress",
               "--output-json", str(out_json))
    assert "Throughput: " in text and " requests/s, " in text and " output tokens/s" in text
    assert "Total num prompt tokens:" in text and "Total num output tokens:" in text
    data = json.loads(out_json.read_text())
    for key in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"):
        assert key in data
    assert data["num_requests"] == 5
    # transformers ran on vlite's device, and the output says which
    assert "Device: cpu" in text and "[hf-static on cpu] Throughput: " in text
    assert data["device"] == "cpu"
    # the tiny model is float32 and greedy: transformers gives the same tokens in both modes
    for name in ("hf-static", "hf-continuous"):
        assert data["baselines"][name]["device"] == "cpu"
        assert data["baselines"][name]["token_agreement"]["identical"] == 1.0
        assert data["baselines"][name]["ratio"] > 0
        assert f"vlite / {name}:" in text


def test_hf_baseline_loads_on_the_device_vlite_ran_on(tiny_model_dir, monkeypatch):
    """`--backend hf` hands the engine's device to transformers: the baseline model's parameters
    live there, and a device this torch lacks is refused in one line."""
    from vlite.bench import runners
    from vlite.cli.main import app

    loaded, args = [], []
    real = runners.load_hf_model
    monkeypatch.setattr(runners, "load_hf_model",
                        lambda *a, **k: args.append((a, k)) or loaded.append(real(*a, **k)) or loaded[-1])
    result = CliRunner().invoke(app, ["bench", "throughput", "--model", str(tiny_model_dir), "--num-prompts", "2",
                                      "--input-len-range", "8:12", "--output-len-range", "2:3", "--backend", "hf",
                                      "--hf-modes", "static", "--device", "cpu", "--num-blocks", "32",
                                      "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(loaded) == 1 and {p.device for p in loaded[0].parameters()} == {torch.device("cpu")}
    (a, k), = args
    assert torch.device((a[2:] or [k.get("device")])[0]) == torch.device("cpu")  # passed, not defaulted
    assert "[hf-static on cpu]" in result.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        real(str(tiny_model_dir), "float32", "cuda")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        real(str(tiny_model_dir), "float16", "cpu")


def test_bench_latency(cli, tiny_model_dir, tmp_path):
    out_json = tmp_path / "l.json"
    text = cli("bench", "latency", "--model", str(tiny_model_dir), "--batch-size", "2", "--input-len", "8",
               "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "3", "--num-blocks", "32",
               "--no-progress", "--output-json", str(out_json))
    assert "Avg latency:" in text and "99% percentile latency:" in text
    data = json.loads(out_json.read_text())
    assert len(data["latencies"]) == 3 and set(data["percentiles"]) == {"10", "25", "50", "75", "90", "99"}


def test_bench_serve_against_a_real_server(cli, tiny_model_dir, tmp_path):
    """`vlite bench serve` starts `vlite serve` on a free loopback port, streams, and stops it."""
    text = cli("bench", "serve", "--model", str(tiny_model_dir), "--num-prompts", "12", "--input-len-range", "8:40",
               "--output-len-range", "2:12", "--request-rate", "40", "--burstiness", "0.5", "--max-concurrency", "6",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--server-args", "--num-blocks 64", "--no-progress", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", "s.json")
    assert "Serving Benchmark Result" in text
    assert "Successful requests:                     12" in text
    assert "Failed requests:                         0" in text
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["completed"] == 12 and data["failed"] == 0
    assert sum(data["output_lens"]) == data["total_output_tokens"]
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_tpot_ms", "p99_itl_ms", "p50_e2el_ms", "std_e2el_ms", "ttfts", "itls", "input_lens"):
        assert key in data, key
    assert all(t > 0 for t in data["ttfts"])


def test_bench_throughput_refuses_a_run_whose_requests_failed(tiny_model_dir, monkeypatch):
    """Every step raises: no throughput figure (it would count tokens never generated), exit 1."""
    from vlite.cli.main import app
    from vlite.engine.worker.models.llama import LlamaForCausalLM

    def broken_forward(self, *args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(LlamaForCausalLM, "forward", broken_forward)
    result = CliRunner().invoke(app, ["bench", "throughput", "--model", str(tiny_model_dir), "--num-prompts", "3",
                                      "--input-len-range", "8:16", "--output-len-range", "2:4", "--num-blocks",
                                      "32", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    assert "3 of 3 requests failed in the engine" in result.output and "simulated kernel failure" in result.output
    assert "Throughput:" not in result.output
