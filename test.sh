#!/usr/bin/env bash
# The whole test suite: ruff, mypy, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
.venv/bin/ruff check kvrecover tests bench examples
.venv/bin/mypy  # the package; settings in pyproject.toml
exec .venv/bin/python -m pytest "$@"
