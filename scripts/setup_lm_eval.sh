#!/usr/bin/env bash
# lm-eval, a real client of the OpenAI server, in its own virtualenv beside the project's
# (.clients-venv; the server tests run its `lm_eval`). Idempotent; ~1 minute the first time.
# torch is pinned to the CPU build the project's own venv uses: a bare `torch` would pull CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.clients-venv
if ! "$VENV/bin/python" -c "import lm_eval" 2>/dev/null; then
    echo "setting up lm-eval in $VENV (once)" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet torch==2.13.0 transformers==5.24.0 "lm-eval[api]==0.4.13"
fi
