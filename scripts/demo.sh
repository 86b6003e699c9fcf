#!/usr/bin/env bash
# Install everything, then run the demo job: a word count on the local driver (one process per
# worker) with embedded local-filesystem checkpoints, a few epochs, exactly-once output.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${DEMO_DIR:-demo-output}
rm -rf "$OUT"
epochstream run examples/wordcount.py:build --deployment local --checkpoint-dir "$OUT/checkpoints"
echo
epochstream checkpoints list --checkpoint-dir "$OUT/checkpoints"
echo
echo "committed word counts (first lines):"
head -q -n 5 $(ls "$OUT"/counts/part-*.jsonl | head -1)
echo "..."
echo "$(cat "$OUT"/counts/part-*.jsonl | wc -l) committed records in $OUT/counts"
