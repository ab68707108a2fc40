#!/usr/bin/env bash
# Install llama-cpp-python (the llama.cpp backend's binding and peer) built the way the backend
# is exact (llamafile's sgemm off; docs/llamacpp.md), from a wheel cache keyed by the version,
# the flags, CMAKE_ARGS, the CPU's flags and the compiler, and prove that it runs on this CPU
# (scripts/install_llamacpp.py says how). Compiles only when that wheel is missing (about 6
# minutes on 2 cores).
# Usage: bash scripts/install_llamacpp.sh [--rebuild] [--safe]   (inside the venv;
# SPECDECODE_WHEELS moves the wheel cache)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
CONSTRAINTS="$HERE/../constraints.txt"
# the binding's own dependencies first: the probe after the build imports it
python3 -m pip install -q -c "$CONSTRAINTS" "diskcache>=5.6.1" "typing-extensions>=4.5.0"
python3 "$HERE/install_llamacpp.py" "$@"
# its OpenAI-compatible server (the [server] extra), a third-party peer for `bench --endpoint`
python3 -m pip install -q -c "$CONSTRAINTS" "sse-starlette>=1.6.1" "starlette-context>=0.3.6,<0.4" "pydantic-settings>=2.0.1" "PyYAML>=5.1"
