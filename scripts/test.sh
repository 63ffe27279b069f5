#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on the OpenCL CPU device (PoCL).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check volconv tests scripts
.venv/bin/ruff format --check volconv tests scripts
.venv/bin/python -m pytest "$@"
