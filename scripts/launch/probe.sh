#!/usr/bin/env bash
# Measure JAGG's gradient quality per group (the paper's Table 5) and the jagg_frac it gives:
#   scripts/launch/probe.sh flux_dance probe.num_rollouts=24
#   scripts/launch/probe.sh flux_dance resume=runs/flux_dance/<run>/checkpoints/<step>   # trained weights
# Writes runs/<experiment>/probe/<date>/probe.json (or RUN_DIR) and prints the table.
# Paths and layout: see common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[[ $# -ge 1 ]] || die "usage: $0 EXPERIMENT [hydra overrides...]"
experiment="$1"
shift
launch train.probe "$experiment" "${RUN_DIR:-runs/$experiment/probe/$(date +%Y-%m-%d_%H-%M-%S)}" "$@"
