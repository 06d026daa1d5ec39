#!/usr/bin/env bash
# Times the README quick start on a fresh clone: `./scripts/serve` to the first 200 from
# /readyz (install + start + model load), the venv's size, then a restart (the environment
# already installed). Usage: bench/quickstart.sh [REPO] [--keep]
#   REPO: what to clone (default: this checkout). Prints one line per figure.
# CPU-heavy (a full pip install): run it on a quiet machine, once.
set -euo pipefail
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
DIR=$(mktemp -d /tmp/fresh-XXXX)
PORT=$(( 20000 + RANDOM % 40000 ))
git clone -q "$SRC" "$DIR/repo"
cd "$DIR/repo"
echo "clone $SRC at $(git rev-parse --short HEAD) -> $DIR/repo, port $PORT"

serve_until_ready() {  # prints seconds from start to the first 200 of /readyz, then stops it
  local t0 pid
  t0=$(date +%s.%N)
  ./scripts/serve --port "$PORT" >"$DIR/serve-$1.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "serve exited early, see $DIR/serve-$1.log"; exit 1; fi
    sleep 0.2
  done
  echo "$1: first 200 from /readyz after $(echo "$(date +%s.%N) - $t0" | bc) s"
  kill -TERM "$pid"; wait "$pid" || true
}

serve_until_ready fresh
echo "venv: $(du -sh .venv | cut -f1) ($(du -sm .venv | cut -f1) MiB)"
serve_until_ready restart
[ "${2:-}" = --keep ] || rm -rf "$DIR"
