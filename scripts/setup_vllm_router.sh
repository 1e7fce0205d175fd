#!/usr/bin/env bash
# vllm-router (vLLM's P/D router: a Rust binary in a Python wheel), a real client of the
# OpenAI server, in the clients' virtualenv beside the project's (.clients-venv; the
# router tests run its `vllm-router`). Idempotent; seconds the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.clients-venv
if ! "$VENV/bin/vllm-router" --help >/dev/null 2>&1; then
    echo "setting up vllm-router in $VENV (once)" >&2
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet "vllm-router==0.1.17"
fi
