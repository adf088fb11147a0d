#!/usr/bin/env bash
# A REAL Prometheus (Debian's `prometheus` package) scraping two `vlite serve` on 127.0.0.1 for a few
# minutes: one clean, one with --inject-fault skip-free-on-abort. Both get the same traffic (waves of
# complete and mid-stream-disconnect requests with idle gaps). Then `vlite leak-check --prometheus`
# judges each job's range from Prometheus's HTTP API, and the API answers are recorded as the fixture
# of the CI test (tests/diagnostics/fixtures/prometheus-range-*.json). Not in CI.
#   apt-get install -y prometheus; tests/interop/prometheus.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-/tmp/vlite-tiny-model}
OUT=${OUT:-/tmp/vlite-prometheus}
WAVES=${WAVES:-6}
PROM=${PROM:-$(command -v prometheus)}
[ -x "$PROM" ] || { echo "no prometheus binary: apt-get install -y prometheus"; exit 2; }
[ -f "$MODEL/config.json" ] || (cd tests && ../.venv/bin/python -c "
from pathlib import Path; from conftest import build_tiny_model_dir; build_tiny_model_dir(Path('$MODEL'))" >/dev/null 2>&1)
rm -rf "$OUT"; mkdir -p "$OUT"
port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P_CLEAN=$(port); P_LEAK=$(port); P_PROM=$(port)
OMP_NUM_THREADS=1 nice -n 10 .venv/bin/vlite serve --model "$MODEL" --host 127.0.0.1 --port "$P_CLEAN" --num-blocks 128 > "$OUT/clean.serve.log" 2>&1 &
S1=$!
OMP_NUM_THREADS=1 nice -n 10 .venv/bin/vlite serve --model "$MODEL" --host 127.0.0.1 --port "$P_LEAK" --num-blocks 128 --inject-fault skip-free-on-abort > "$OUT/leak.serve.log" 2>&1 &
S2=$!
cat > "$OUT/prometheus.yml" <<YML
global: {scrape_interval: 1s, evaluation_interval: 15s}
scrape_configs:
  - job_name: vlite-clean
    static_configs: [{targets: ["127.0.0.1:$P_CLEAN"]}]
  - job_name: vlite-leak
    static_configs: [{targets: ["127.0.0.1:$P_LEAK"]}]
YML
nice -n 10 "$PROM" --config.file="$OUT/prometheus.yml" --storage.tsdb.path="$OUT/tsdb" \
  --web.listen-address="127.0.0.1:$P_PROM" > "$OUT/prometheus.log" 2>&1 &
SP=$!
trap 'kill -TERM $S1 $S2 $SP 2>/dev/null; wait 2>/dev/null' EXIT
for p in $P_CLEAN $P_LEAK; do for _ in $(seq 1 180); do curl -sf "127.0.0.1:$p/health" >/dev/null && break; sleep 1; done; done
for _ in $(seq 1 60); do curl -sf "127.0.0.1:$P_PROM/-/ready" >/dev/null && break; sleep 1; done
START=$(date +%s)
sleep 8  # a baseline idle stretch in Prometheus
OMP_NUM_THREADS=1 .venv/bin/python - "$P_CLEAN" "$P_LEAK" "$WAVES" <<'PY'
import sys, time, httpx
ports, waves = sys.argv[1:3], int(sys.argv[3])
def complete(base, i):
    httpx.post(f"{base}/v1/completions", json={"prompt": f"prom {i}", "max_tokens": 16, "ignore_eos": True}, timeout=60)
def leave(base, i):
    body = {"prompt": f"prom {i} leave", "max_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                n += 1
                if n >= 2:
                    break
for w in range(waves):
    for p in ports:
        base = f"http://127.0.0.1:{p}"
        for k in range(3):
            complete(base, 10 * w + k)
        for k in range(2):
            leave(base, 10 * w + 5 + k)
    print(f"wave {w + 1} sent", flush=True)
    time.sleep(8)  # an idle stretch of several scrapes
PY
sleep 5
END=$(date +%s); SINCE=$(( END - START + 5 ))s
echo "traffic over $(( END - START )) s; judging the last $SINCE"
for job in vlite-clean vlite-leak; do
  OMP_NUM_THREADS=1 .venv/bin/vlite leak-check --prometheus "http://127.0.0.1:$P_PROM" --job "$job" --since "$SINCE" \
    --interval 1 --report "$OUT/$job" > "$OUT/$job.txt" 2>&1
  echo "$job: exit $? $(grep '^verdict' "$OUT/$job.txt")"
  [ -n "${RECORD:-}" ] && OMP_NUM_THREADS=1 .venv/bin/python tests/interop/record_prometheus.py \
    "http://127.0.0.1:$P_PROM" "$job" "$SINCE" "tests/diagnostics/fixtures/prometheus-range-$job.json"
done
"$PROM" --version 2>&1 | head -1
