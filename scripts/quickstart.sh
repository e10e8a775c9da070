#!/usr/bin/env bash
# Sets up .venv, starts pagedserve (scheduler + executor) with the default model, streams one
# answer, then keeps serving on localhost:50051 until Ctrl-C. PAGEDSERVE_QUICKSTART_ONCE=1 stops
# after the answer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
pagedserve serve > pagedserve.log 2>&1 &  # server logs (one JSON line per request) go here
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null' EXIT
echo "starting (the first start converts the default model once, ~40 s)..."
until pagedserve health >/dev/null 2>&1; do
  kill -0 "$SERVE" 2>/dev/null || { tail -20 pagedserve.log >&2; echo "pagedserve serve exited" >&2; exit 1; }
  sleep 1
done
echo '$ pagedserve generate --chat "What is the capital of France?" --temperature 0'
pagedserve generate --chat "What is the capital of France?" --temperature 0
[ "${PAGEDSERVE_QUICKSTART_ONCE:-0}" = 1 ] && exit 0
echo "serving on localhost:50051 (metrics on :8000/metrics, logs in pagedserve.log); Ctrl-C stops"
wait $SERVE
