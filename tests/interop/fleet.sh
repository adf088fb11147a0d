#!/usr/bin/env bash
# `make fleet`: a fleet of real parts on 127.0.0.1, then `vlite leak-check --url ROUTER --replica ...`
# against it. Not in CI (minutes, and it installs a router and Prometheus).
#   - two `vlite serve` replicas (the default model, SmolLM2-135M-Instruct; MODEL=tiny for a tiny random
#     model on a busy machine);
#   - vllm-router 0.1.17 from PyPI (a Rust binary in its wheel) in its own venv, .venv-fleet, power_of_two;
#   - Debian's prometheus scraping the router's --prometheus-port and every replica every second
#     (apt-get install when missing and root).
# Three proofs, each checked from fleet.json:
#   1. clean fleet through vllm-router: every replica CLEAN (exit 0), and what the router does when a
#      client leaves (the replica counts the abort, and how soon);
#   2. the same replicas behind tests/interop/drop_abort_proxy.py --drop-aborts (a router that does NOT
#      pass aborts on): every replica ZOMBIE, hop "router -> replica" (exit 1);
#   3. replica B restarted with --inject-fault skip-free-on-abort behind vllm-router: B LEAK, A CLEAN (exit 1).
# Then `vlite leak-check --prometheus` per instance over the range Prometheus recorded (reported, not
# checked here). Stops every process it started. Output in $OUT (default fleet-report/); RECORD=1 copies
# each run's fleet.json to tests/diagnostics/fixtures/fleet-live-*.json (the CI test re-judges them).
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
OUT=${OUT:-fleet-report}
VENV=${FLEET_VENV:-.venv-fleet}
PY=${PY:-.venv/bin/python}
VLITE=${VLITE:-.venv/bin/vlite}
ROUTER_VERSION=${ROUTER_VERSION:-0.1.17}
NUM_REQUESTS=${NUM_REQUESTS:-12}
rm -rf "$OUT" && mkdir -p "$OUT"
if [ ! -x "$VENV/bin/vllm-router" ]; then
  echo "fleet: installing vllm-router==$ROUTER_VERSION into $VENV (its own venv)"
  python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "vllm-router==$ROUTER_VERSION" \
    || { echo "fleet: vllm-router install failed"; exit 2; }
fi
PROM=${PROM:-$(command -v prometheus)}
if [ -z "$PROM" ] && [ "$(id -u)" = 0 ]; then
  echo "fleet: installing Debian's prometheus (apt-get)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus) > "$OUT/apt.log" 2>&1
  PROM=$(command -v prometheus)
fi
[ -n "$PROM" ] || echo "fleet: no prometheus binary (apt-get install -y prometheus as root): going on without it"
MODEL_ARGS=()
if [ "${MODEL:-}" = tiny ]; then
  MODEL_DIR=/tmp/vlite-tiny-model
  case $PY in /*) PY_ABS=$PY ;; *) PY_ABS=$PWD/$PY ;; esac
  [ -f "$MODEL_DIR/config.json" ] || (cd tests && "$PY_ABS" -c "
from pathlib import Path; from conftest import build_tiny_model_dir; build_tiny_model_dir(Path('$MODEL_DIR'))" >/dev/null 2>&1)
  MODEL_ARGS=(--model "$MODEL_DIR" --num-blocks 256)
elif [ -n "${MODEL:-}" ]; then
  MODEL_ARGS=(--model "$MODEL")
fi
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PA=$(port); PB=$(port); PR=$(port); PRM=$(port); PX=$(port); PP=$(port)
A=http://127.0.0.1:$PA; B=http://127.0.0.1:$PB; R=http://127.0.0.1:$PR; X=http://127.0.0.1:$PX
PIDS=()
start() {  # start NAME CMD...: in its own process group, log in $OUT/NAME.log; sets LAST
  local name=$1; shift
  setsid "$@" > "$OUT/$name.log" 2>&1 &
  LAST=$!; PIDS+=("$LAST")
}
stop_group() {  # SIGTERM the process group of $1, SIGKILL after 20 s
  kill -TERM -- "-$1" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$1" 2>/dev/null
}
cleanup() { for p in "${PIDS[@]}"; do stop_group "$p"; done; wait 2>/dev/null; }
trap cleanup EXIT
trap 'exit 130' INT TERM  # the EXIT trap then stops every process started
healthy() { for _ in $(seq 1 "${2:-600}"); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
serve() {  # serve NAME PORT [extra args]
  local name=$1 p=$2; shift 2
  OMP_NUM_THREADS=1 start "$name" "$VLITE" serve --host 127.0.0.1 --port "$p" "${MODEL_ARGS[@]}" "$@"
}
serve replica-a "$PA"; PID_A=$LAST
serve replica-b "$PB"; PID_B=$LAST
healthy "$A" && healthy "$B" || { echo "fleet: a replica did not start:"; tail -5 "$OUT"/replica-*.log; exit 2; }
echo "fleet: replicas ready at $A and $B after $(( $(date +%s) - START )) s"
# power_of_two: vllm-router exports its in-flight gauge per worker (vllm_router_running_requests) only for
# load-aware policies, not round_robin (measured); the check reconciles it with the replicas at idle.
start router "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$PR" --worker-urls "$A" "$B" --policy "${ROUTER_POLICY:-power_of_two}" \
  --prometheus-host 127.0.0.1 --prometheus-port "$PRM" --log-level info
healthy "$R" 120 || { echo "fleet: vllm-router did not start:"; tail -5 "$OUT/router.log"; exit 2; }
if [ -n "$PROM" ]; then
  cat > "$OUT/prometheus.yml" <<YML
global: {scrape_interval: 1s, evaluation_interval: 15s}
scrape_configs:
  - job_name: vlite-replicas
    static_configs: [{targets: ["127.0.0.1:$PA", "127.0.0.1:$PB"]}]
  - job_name: vllm-router
    static_configs: [{targets: ["127.0.0.1:$PRM"]}]
YML
  start prometheus "$PROM" --config.file="$OUT/prometheus.yml" --storage.tsdb.path="$OUT/tsdb" \
    --web.listen-address="127.0.0.1:$PP"
  for _ in $(seq 1 60); do curl -sf "127.0.0.1:$PP/-/ready" >/dev/null && break; sleep 1; done
fi
PROM_START=$(date +%s)
check() {  # check NAME ROUTER_URL [--router-metrics URL]: leak-check the fleet, keep its output
  local name=$1 url=$2; shift 2
  OMP_NUM_THREADS=1 "$VLITE" leak-check --url "$url" --replica "$A" --replica "$B" "$@" \
    --num-requests "$NUM_REQUESTS" --abort-rate 0.4 --output-len 8:24 --zombie-max-tokens 128 \
    --drain-timeout 120 --report "$OUT/$name" > "$OUT/$name.txt" 2>&1
  echo "$?" > "$OUT/$name.rc"
  curl -s "http://127.0.0.1:$PRM/metrics" > "$OUT/$name.router.prom"
  echo "fleet: $name: exit $(cat "$OUT/$name.rc"); $(grep '^verdict' "$OUT/$name.txt")"
  [ -n "${RECORD:-}" ] && cp "$OUT/$name/fleet.json" "tests/diagnostics/fixtures/fleet-live-$name.json"
}
check clean "$R" --router-metrics "http://127.0.0.1:$PRM"
start proxy "$PY" tests/interop/drop_abort_proxy.py --port "$PX" --drop-aborts --upstream "$A" --upstream "$B"
healthy "$X" 30
check drop-aborts "$X"
stop_group "$LAST"
echo "fleet: restarting replica B with --inject-fault skip-free-on-abort"
stop_group "$PID_B"
serve replica-b-fault "$PB" --inject-fault skip-free-on-abort
healthy "$B" || { echo "fleet: replica B did not restart"; exit 2; }
check leak "$R" --router-metrics "http://127.0.0.1:$PRM"
if [ -n "$PROM" ]; then
  sleep 3
  SINCE=$(( $(date +%s) - PROM_START + 5 ))s
  for inst in "127.0.0.1:$PA" "127.0.0.1:$PB"; do
    OMP_NUM_THREADS=1 "$VLITE" leak-check --prometheus "http://127.0.0.1:$PP" --job vlite-replicas --instance "$inst" \
      --since "$SINCE" --interval 1 > "$OUT/prometheus-$inst.txt" 2>&1
    echo "fleet: --prometheus --instance $inst over the last $SINCE: exit $? $(grep '^verdict' "$OUT/prometheus-$inst.txt")"
  done
  curl -s "127.0.0.1:$PP/api/v1/query?query=up" > "$OUT/prometheus-up.json"
fi
{ echo "vllm-router $("$VENV/bin/pip" show vllm-router 2>/dev/null | sed -n 's/^Version: //p')"
  [ -n "$PROM" ] && "$PROM" --version 2>&1 | head -1
  echo "vlite $(git rev-parse --short HEAD 2>/dev/null)"; } > "$OUT/versions.txt"
cat "$OUT/versions.txt"
"$PY" - "$OUT" "$A" "$B" <<'PY' || exit 1
import json, sys
out, a, b = sys.argv[1:4]
def load(name):
    return json.load(open(f"{out}/{name}/fleet.json")), int(open(f"{out}/{name}.rc").read())
def rep(res, url):
    return next(r for r in res["replicas"] if r["url"] == url)
clean, rc_clean = load("clean")
drop, rc_drop = load("drop-aborts")
leak, rc_leak = load("leak")
router_probes = [p for p in clean["probes"] if p["path"] == "router"]
passed_on = [p for p in router_probes if p["aborted"]]
lag = [round(p["ended_at"] - p["left_at"], 3) for p in router_probes if p["ended_at"] and p["left_at"]]
print(f"fleet: vllm-router passed {len(passed_on)}/{len(router_probes)} client aborts on to the replica; "
      f"client left -> replica counted it ended: {lag} s")
checks = {
    "clean: exit 0, every replica CLEAN": rc_clean == 0 and all(r["verdict"] == "CLEAN" for r in clean["replicas"]),
    "drop-aborts: exit 1, every replica ZOMBIE at hop router -> replica": rc_drop == 1 and all(
        r["verdict"] == "ZOMBIE" and r["hop"] == "router -> replica" for r in drop["replicas"]),
    "leak: exit 1, replica B LEAK": rc_leak == 1 and rep(leak, b)["verdict"] == "LEAK",
    "leak: replica A CLEAN": rep(leak, a)["verdict"] == "CLEAN",
    "clean: router in flight reconciled at idle (CLEAN)": clean["router"]["verdict"] == "CLEAN",
}
for what, ok in checks.items():
    print(f"fleet: {'ok  ' if ok else 'FAIL'} {what}")
sys.exit(0 if all(checks.values()) else 1)
PY
echo "fleet: passed in $(( $(date +%s) - START )) s"
