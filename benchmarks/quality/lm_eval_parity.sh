#!/usr/bin/env bash
# EleutherAI's lm-evaluation-harness against `vlite serve`: `lm_eval --model
# local-completions` runs a loglikelihood task (multiple choice: echo + logprobs) and a
# generate-until task, offline, on a small task defined from local files; then `lm_eval --model
# hf` scores the loglikelihood task on the same weights in transformers, and every per-choice
# loglikelihood must agree within 1e-3 (compare_lm_eval.py). Results are written to docs/serve.md
# by hand from what this prints.
#
#   bash benchmarks/quality/lm_eval_parity.sh [MODEL_DIR]     (from the repository root, after `make setup`)
#
# MODEL_DIR: a Hugging Face directory both sides load; default: the default model's GGUF
# conversion in vlite's cache (~/.cache/vlite/gguf/SmolLM2-135M-Instruct.Q4_1-*: float32
# safetensors + tokenizer). lm-eval goes into its own venv, .venv-lmeval (torch==2.13.0 first, the
# CPU wheel, so that no CUDA build is pulled), never into .venv. About 2 minutes after the install.
set -euo pipefail
ROOT=$(pwd)
LMEVAL_VENV=${LMEVAL_VENV:-$ROOT/.venv-lmeval}
if [ ! -x "$LMEVAL_VENV/bin/lm_eval" ]; then
  python3 -m venv "$LMEVAL_VENV"
  "$LMEVAL_VENV/bin/pip" install -q torch==2.13.0
  "$LMEVAL_VENV/bin/pip" install -q "lm_eval[hf,api]==0.4.13"
fi
MODEL_DIR=${1:-$("$ROOT/.venv/bin/python" -c "from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)")}
WORK=$(mktemp -d)
PORT=$("$ROOT/.venv/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_DATASETS_CACHE="$WORK/hf-datasets" HF_HOME="$WORK/hf-home"

# ---- the tasks: YAML over JSONL files written here --------------------------------------------
mkdir -p "$WORK/tasks"
cat > "$WORK/mc.jsonl" <<'EOF'
{"question": "The capital of France is", "choices": ["Paris", "London", "Berlin", "Madrid"], "answer": 0}
{"question": "Water freezes at a temperature of zero degrees", "choices": ["Celsius", "Kelvin", "Fahrenheit"], "answer": 0}
{"question": "The largest planet in the solar system is", "choices": ["Mars", "Jupiter", "Venus", "Mercury"], "answer": 1}
{"question": "A week has seven", "choices": ["days", "months", "years"], "answer": 0}
{"question": "The opposite of hot is", "choices": ["warm", "cold", "bright"], "answer": 1}
{"question": "def add(a, b):\n    return a", "choices": [" + b", " - b", " * b"], "answer": 0}
{"question": "Roses are red, violets are", "choices": ["blue", "green", "loud"], "answer": 0}
{"question": "The sun rises in the", "choices": ["east", "west", "north", "south"], "answer": 0}
EOF
cat > "$WORK/gen.jsonl" <<'EOF'
{"question": "What is the capital of France?", "answer": "Paris"}
{"question": "What is 2 + 2?", "answer": "4"}
{"question": "What color is the sky on a clear day?", "answer": "Blue"}
{"question": "How many legs does a spider have?", "answer": "8"}
EOF
cat > "$WORK/tasks/vlite_mc.yaml" <<EOF
task: vlite_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: $WORK/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
EOF
cat > "$WORK/tasks/vlite_gen.yaml" <<EOF
task: vlite_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: $WORK/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Question: {{question}}\nAnswer:"
doc_to_target: " {{answer}}"
generation_kwargs:
  until: ["\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
EOF

# ---- vlite serve -------------------------------------------------------------------------------
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$ROOT/.venv/bin/vlite" serve --model "$MODEL_DIR" --host 127.0.0.1 \
  --port "$PORT" --served-model-name vlite-parity --dtype float32 > "$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SERVER || { cat "$WORK/serve.log"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "server did not start"; tail "$WORK/serve.log"; exit 1; }

t0=$(date +%s)
"$LMEVAL_VENV/bin/lm_eval" run --model local-completions \
  --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=vlite-parity,tokenizer=$MODEL_DIR,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1" \
  --tasks vlite_mc,vlite_gen --include_path "$WORK/tasks" --output_path "$WORK/out-vlite" --log_samples \
  2>&1 | tee "$WORK/vlite.txt" | grep -E "^\|" || true
t1=$(date +%s)
"$LMEVAL_VENV/bin/lm_eval" run --model hf --model_args "pretrained=$MODEL_DIR,dtype=float32" --device cpu \
  --batch_size 1 --tasks vlite_mc,vlite_gen --include_path "$WORK/tasks" --output_path "$WORK/out-hf" --log_samples \
  2>&1 | tee "$WORK/hf.txt" | grep -E "^\|" || true
t2=$(date +%s)
echo "lm_eval local-completions against vlite serve: $((t1 - t0)) s; lm_eval hf: $((t2 - t1)) s"
"$ROOT/.venv/bin/python" "$ROOT/benchmarks/quality/compare_lm_eval.py" "$WORK/out-vlite" "$WORK/out-hf" --tol 1e-3
