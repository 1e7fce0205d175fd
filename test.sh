#!/usr/bin/env bash
# The whole test suite: ruff, mypy, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
scripts/setup_lm_eval.sh  # for tests/entrypoints/server/test_lm_eval.py
scripts/setup_vllm_router.sh  # for tests/entrypoints/router
export KVRECOVER_CLIENTS_BIN="$PWD/.clients-venv/bin"
.venv/bin/ruff check kvrecover tests bench examples
.venv/bin/mypy  # the package; settings in pyproject.toml
exec .venv/bin/python -m pytest "$@"
