#!/usr/bin/env bash
# Install the mmdetection path (mmcv 2.1.0 with compiled ops, mmengine, mmdet 3.3.0) into a
# Python environment that already holds torch, sharing its torch.
#
# mmcv is source-only on PyPI and its setup.py hard-codes -std=c++17, while torch >= 2.10 headers
# need C++20; we patch that one flag and build a wheel once (about 18-25 min on 2 cores), caching it
# in $UNNORM_WHEEL_CACHE keyed by the torch version, so later installs take seconds.
# GPU clusters: run with FORCE_CUDA=1 (and a CUDA toolkit) to build the CUDA ops as well.
#
#   usage: scripts/install_mmdet.sh [python]      (default: .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
CACHE=${UNNORM_WHEEL_CACHE:-$HOME/.cache/unnorm/wheels}
MMCV_SHA256=d387bcab66b467479b6660310e23746cfc79c6e57acf04094680adb499a5cd3f  # mmcv-2.1.0.tar.gz

# mmcv's build and mmengine's imports use pkg_resources, which setuptools 81 removed.
"$PY" -m pip install -q "setuptools>=64,<81"
TORCH=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
CUDA_TAG=$([ "${FORCE_CUDA:-0}" = 1 ] && echo cuda || echo cpu)
WHEEL_DIR="$CACHE/mmcv-2.1.0-torch$TORCH-$CUDA_TAG"

if ! ls "$WHEEL_DIR"/mmcv-2.1.0-*.whl >/dev/null 2>&1; then
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    echo "building mmcv 2.1.0 against torch $TORCH ($CUDA_TAG); this takes about 20 minutes" >&2
    # through pip, so its configured index, mirror or proxy serves the sdist
    "$PY" -m pip download -q --no-binary :all: --no-deps --no-build-isolation mmcv==2.1.0 -d "$WORK"
    echo "$MMCV_SHA256  $WORK/mmcv-2.1.0.tar.gz" | sha256sum -c --quiet
    tar -xzf "$WORK/mmcv-2.1.0.tar.gz" -C "$WORK"
    grep -q -- "-std=c++17" "$WORK/mmcv-2.1.0/setup.py"
    sed -i 's/-std=c++17/-std=c++20/' "$WORK/mmcv-2.1.0/setup.py"
    mkdir -p "$WHEEL_DIR"
    MMCV_WITH_OPS=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip wheel -q --no-build-isolation \
        --no-deps -w "$WHEEL_DIR" "$WORK/mmcv-2.1.0"
fi
"$PY" -m pip install -q "$WHEEL_DIR"/mmcv-2.1.0-*.whl -c constraints.txt -r requirements/mmdet.txt
"$PY" -c 'import mmcv.ops, mmdet.models; print("mmdet", __import__("mmdet").__version__, "with mmcv ops")'
