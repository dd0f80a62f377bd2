#!/usr/bin/env bash
# Loads the status page (`/`) of a running engine in a real headless browser, during a sync
# and after it settled, and checks that the progress line and the estimate are rendered.
#
# It runs the demo (examples/demo.rs) with its status listener, relay C answering each EOSE
# 2 s late within a budget of 2 subscriptions (a sync of about a minute), then:
#   1. waits until the page shows an estimate in seconds, loads it with chromium
#      (--dump-dom: the DOM must hold "Progress:", "history queries pending:" and
#      "time to settle: <N>s"; --screenshot: OUT/status-during-sync.png);
#   2. waits until it shows "time to settle: 0s (settled)" and checks and captures it again
#      (OUT/status-settled.png).
#
#   docs/check-status-page.sh                 # chromium from PATH
#   CHROMIUM=/usr/bin/chromium OUT=/tmp/shots PORT=19470 docs/check-status-page.sh
#
# Skipped (exit 0, with the reason) when no chromium is found. Exit 1 when a check fails.
# Screenshots are for a person to look at; they are not committed.
set -euo pipefail
cd "$(dirname "$0")/.."

CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [ -z "$CHROMIUM" ] || [ ! -x "$CHROMIUM" ]; then
    echo "check-status-page: skipped: no chromium found (set CHROMIUM=/path/to/chromium)"
    exit 0
fi
OUT=${OUT:-$(mktemp -d)}
PORT=${PORT:-19470}
URL="http://127.0.0.1:$PORT/"
mkdir -p "$OUT"
echo "browser: $("$CHROMIUM" --version 2>/dev/null | tail -n 1) ($CHROMIUM)"

cargo build --quiet --features testing --example demo
GRASP_SYNC_DEMO_METRICS_ADDR="127.0.0.1:$PORT" GRASP_SYNC_DEMO_HOLD_SECS=60 \
    GRASP_SYNC_DEMO_EOSE_DELAY_MS=2000 target/debug/examples/demo >"$OUT/demo.log" 2>&1 &
DEMO=$!
PROFILES=()
cleanup() {
    kill "$DEMO" 2>/dev/null || true
    wait "$DEMO" 2>/dev/null || true
    for p in "${PROFILES[@]}"; do rm -rf "$p"; done
}
trap cleanup EXIT

browser() {
    local profile
    profile=$(mktemp -d)
    PROFILES+=("$profile")
    "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$profile" --window-size=1280,900 "$@" 2>/dev/null
}

# Waits (at most $2 s) until the page served matches the extended regular expression $1.
wait_for() {
    local end=$((SECONDS + $2))
    while [ $SECONDS -lt $end ]; do
        if curl -fsS --max-time 5 "$URL" 2>/dev/null | grep -Eq "$1"; then
            return 0
        fi
        sleep 0.5
    done
    echo "check-status-page: FAILED: the page never matched /$1/ within $2 s"
    echo "--- demo output ($OUT/demo.log), last lines:"
    tail -n 5 "$OUT/demo.log"
    exit 1
}

# Loads the page in the browser: checks its DOM for each pattern after the first argument
# and saves a screenshot to $1.
check() {
    local shot=$1
    shift
    local dom
    dom=$(browser --dump-dom "$URL")
    for pattern in "$@"; do
        if ! grep -Eq "$pattern" <<<"$dom"; then
            echo "check-status-page: FAILED: /$pattern/ not in the DOM chromium rendered"
            exit 1
        fi
    done
    grep -Eo 'Progress:[^<]*(<b>[^<]*</b>)?' <<<"$dom" | sed 's/<[^>]*>//g; s/^/  /'
    browser --screenshot="$shot" "$URL" >/dev/null
    [ -s "$shot" ] || { echo "check-status-page: FAILED: no screenshot"; exit 1; }
    echo "  screenshot: $shot"
}

echo "during the sync:"
wait_for 'time to settle: [0-9]+(m[0-9]+)?s</b>' 120
check "$OUT/status-during-sync.png" 'Progress:' 'history queries pending: [1-9]' \
    'time to settle: [0-9]+(m[0-9]+)?s' '<th>Time to settle</th>'
echo "settled:"
wait_for 'time to settle: 0s \(settled\)' 180
check "$OUT/status-settled.png" 'history queries pending: 0' \
    'time to settle: 0s \(settled\)' 'settled: <b>true</b>'
echo "check-status-page: OK"
