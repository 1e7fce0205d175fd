#!/usr/bin/env bash
# The main job: the reference KV-load-failure recovery scenario on the default model.
# Extra arguments go to `kvrecover scenario` (e.g. --model PATH, --workdir DIR).
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
exec .venv/bin/kvrecover scenario "$@"
