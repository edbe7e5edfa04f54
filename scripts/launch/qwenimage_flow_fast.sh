#!/usr/bin/env bash
# The paper's qwenimage_flow_fast run on one node of 8 GPUs (configs/experiment/qwenimage_flow_fast.yaml); extra arguments are
# Hydra overrides, e.g. update=exact or update=ablate. Paths: see common.sh. Several nodes: multinode.sh.
exec "$(dirname "${BASH_SOURCE[0]}")/train.sh" qwenimage_flow_fast "$@"
