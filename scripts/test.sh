#!/usr/bin/env bash
# Install with the dev extras, then run the CPU test suite (what CI runs). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
export TRITON_INTERPRET=1
python3 -m pytest -q -m "not gpu" --timeout=900 tests "$@"
