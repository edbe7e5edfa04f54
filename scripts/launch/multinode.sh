#!/usr/bin/env bash
# One experiment on NNODES nodes of NPROC_PER_NODE GPUs: run this on every node, with the same
# RUN_DIR (a shared filesystem) and MASTER_ADDR (node 0's address, the c10d rendezvous endpoint
# MASTER_ADDR:MASTER_PORT), and that node's NODE_RANK.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 RUN_DIR=/shared/runs/flux_dance/2n \
#       scripts/launch/multinode.sh flux_dance update=jagg
# The global batch grows with the world size (prompts_per_rank is per rank); rescale it if needed.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[[ $# -ge 1 ]] || die "usage: $0 EXPERIMENT [hydra overrides...]"
(( NNODES > 1 )) || die "NNODES=$NNODES: for one node use train.sh"
require NODE_RANK MASTER_ADDR RUN_DIR
experiment="$1"
shift
launch train "$experiment" "$RUN_DIR" "$@"
