#!/usr/bin/env bash
# Prefill, then decode three times (baseline, sync failure, async failure), then
# check the recovered outputs equal the baseline byte for byte.
# Run it from any folder; the files land in the current one. Extra args (e.g.
# --model PATH) go to every phase.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-$HERE/../../.venv/bin/python}"
rm -rf local_storage
rm -f prefill_output.txt decode_output.txt sync_decode_recovered_output.txt async_decode_recovered_output.txt

"$PYTHON" "$HERE/prefill_example.py" "$@"
"$PYTHON" "$HERE/decode_example.py" "$@"
"$PYTHON" "$HERE/decode_example.py" --simulate-failure "$@"
"$PYTHON" "$HERE/decode_example.py" --simulate-failure --async-load "$@"

for recovered in sync_decode_recovered_output.txt async_decode_recovered_output.txt; do
    if ! cmp -s decode_output.txt "$recovered"; then
        echo "FAILED: $recovered differs from the baseline"
        diff -u decode_output.txt "$recovered"
        exit 1
    fi
done
echo "SUCCESS: recovered outputs match the baseline."
