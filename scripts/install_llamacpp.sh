#!/usr/bin/env bash
# Install llama-cpp-python (the llama.cpp backend's binding) built the way the backend is exact:
# without llamafile's sgemm kernels, whose blockings depend on the batch shape (see
# docs/llamacpp.md). pip's own wheel cache does not key on CMAKE_ARGS, so a wheel built with
# other flags could be reused silently: this script keeps its own cache, keyed by version and
# flags, and compiles only when that wheel is missing (about 6 minutes on 2 cores).
# Usage: bash scripts/install_llamacpp.sh   (inside the venv; SPECDECODE_WHEELS moves the cache)
set -euo pipefail
VERSION=0.3.36
FLAGS="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=OFF -DLLAMA_OPENSSL=OFF"
KEY=$(printf '%s %s %s' "$VERSION" "$FLAGS" "$(uname -m)-$(python3 -c 'import sys; print(sys.implementation.cache_tag)')" | sha256sum | cut -c1-16)
DIR="${SPECDECODE_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/specdecode/wheels}/llama-cpp-python-$KEY"
if ! ls "$DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION with $FLAGS (about 6 minutes on 2 cores)" >&2
    mkdir -p "$DIR.tmp"
    CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        python3 -m pip wheel -q --no-deps --no-cache-dir -w "$DIR.tmp" "llama-cpp-python==$VERSION"
    rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
fi
python3 -m pip install -q --no-deps --force-reinstall "$DIR"/llama_cpp_python-*.whl
CONSTRAINTS="$(dirname "$0")/../constraints.txt"
python3 -m pip install -q -c "$CONSTRAINTS" "diskcache>=5.6.1" "typing-extensions>=4.5.0"
# its OpenAI-compatible server (the [server] extra), a third-party peer for `bench --endpoint`
python3 -m pip install -q -c "$CONSTRAINTS" "sse-starlette>=1.6.1" "starlette-context>=0.3.6,<0.4" "pydantic-settings>=2.0.1" "PyYAML>=5.1"
