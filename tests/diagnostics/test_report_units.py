"""The numbers of a black-box and a --from-log report carry their unit and the moment they were
read, so that two of them never read as a contradiction."""

from __future__ import annotations

import pandas as pd
from report_words import assert_no_none, blackbox_text

from vlite.diagnostics.targets.blackbox import BlackboxResult
from vlite.diagnostics.targets.from_log import analyze_log
from vlite.diagnostics.workload.replay import ReplayResult

VLLM_LINE = ("(APIServer pid=8896) INFO 11-30 22:59:{s:02d} [loggers.py:335] Engine 000: Avg prompt throughput: 3.2 "
             "tokens/s, Avg generation throughput: 0.1 tokens/s, Running: {r} reqs, Waiting: 0 reqs, "
             "GPU KV cache usage: {u}%, Prefix cache hit rate: 0.0%")


def test_blackbox_report_names_the_moment_and_unit_of_each_kv_number():
    # the verdict read 38 blocks after the waves; bisection and the zombie check then leaked more
    probes = [{"time": 1.0, "after": "wave 5", "request_id": "p1", "status": 200, "kv_used_before": 38.0,
               "kv_used_after": 38.0},
              {"time": 2.0, "after": "b0-3", "request_id": "p2", "status": 200, "kv_used_before": 119.0,
               "kv_used_after": 119.0}]
    res = BlackboxResult("LEAK", "LEAK: 38 blocks of KV cache still used at idle after the 6 waves", "vlite",
                         "blocks", 16, 256.0, 0.0, 38.0, [], pd.DataFrame(), ReplayResult([]), probes=probes,
                         kv_at_end=198.0)
    text = blackbox_text(res)
    assert_no_none(text)
    assert "KV used at idle (blocks): baseline 0 -> 38 after the waves (the verdict's reading" in text
    assert "198 blocks when the check ended" in text
    assert "the last one (after b0-3): KV used 119 -> 119 blocks" in text
    assert "KV 119.0" not in text


def test_from_log_trend_is_per_idle_stretch_in_the_logs_unit(tmp_path):
    # one idle line per stretch, the troughs rising 2% of the pool each time
    usage = [(3, 5.0), (0, 0.0), (3, 7.0), (0, 2.0), (3, 9.0), (0, 4.0), (3, 11.0), (0, 6.0)]
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(VLLM_LINE.format(s=i * 5, r=r, u=u) for i, (r, u) in enumerate(usage)) + "\n")
    res = analyze_log(log)
    assert res.verdict == "LEAK" and "2 percent per idle stretch" in res.summary, res.summary
    text = blackbox_text(res)
    assert "slope 2 percent per idle stretch" in text, text
    assert "/request" not in text
