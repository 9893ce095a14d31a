#!/usr/bin/env bash
# The GPU paths in one short run (< 5 min on one H200, no network): the tiny model is built (or reused)
# under $GPU_CHECK_DIR (default .cache, where the tests keep it), then bench/gpu_check.py prints ONE JSON
# line with every figure and each check's ok / skipped / failed. Uses .venv/bin/python when the venv was
# carried along, else `python`. Extra arguments go to gpu_check.py (e.g. --device cpu for the reduced
# form on a machine without a GPU).
#
#   bash bench/gpu_check.sh [--device cpu] [--tokens N]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=python
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
DIR="${GPU_CHECK_DIR:-.cache}"
LIMIT_S="${GPU_CHECK_TIMEOUT_S:-290}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The model's path is the last line the builder prints; its progress goes to stderr.
MODEL="$(timeout 240 "$PYTHON" -m sparkrl.cli build-tiny-model --out "$DIR" | tail -n 1)"
exec timeout --signal=TERM --kill-after=10 "$LIMIT_S" "$PYTHON" bench/gpu_check.py --model "$MODEL" "$@"
