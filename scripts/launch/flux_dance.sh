#!/usr/bin/env bash
# The paper's flux_dance run on one node of 8 GPUs (configs/experiment/flux_dance.yaml); extra arguments are
# Hydra overrides, e.g. update=exact or update=ablate. Paths: see common.sh. Several nodes: multinode.sh.
exec "$(dirname "${BASH_SOURCE[0]}")/train.sh" flux_dance "$@"
