#!/usr/bin/env bash
# Train one experiment: scripts/launch/train.sh EXPERIMENT [hydra overrides...]
#   scripts/launch/train.sh flux_dance update=exact
#   NPROC_PER_NODE=1 scripts/launch/train.sh demo num_steps=2      # the CPU demo
# One node with NPROC_PER_NODE GPUs (default 8); set NNODES > 1 for several (see multinode.sh).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[[ $# -ge 1 ]] || die "usage: $0 EXPERIMENT [hydra overrides...]"
experiment="$1"
shift
launch train "$experiment" "$(run_dir_for "$experiment" train)" "$@"
