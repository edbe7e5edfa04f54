#!/usr/bin/env bash
# A first run on one GPU, written to one results folder (docs/gpu_check.md):
#   scripts/gpu_check.sh [--out DIR] [--flux-path DIR] [--qwenimage-path DIR]
#   scripts/gpu_check.sh --cpu --out DIR          # the CPU mode (tiny sizes, gloo), as the test suite runs it
# PYTHON picks the interpreter (default: python).
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "${BASH_SOURCE[0]}")/gpu_check.py" "$@"
