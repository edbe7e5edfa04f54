#!/usr/bin/env bash
# Run exact, jagg and ablate of one experiment, one after the other, in one wandb group, then compare:
#   scripts/launch/compare_modes.sh flux_dance [hydra overrides for all three runs...]
#   NPROC_PER_NODE=1 scripts/launch/compare_modes.sh demo num_steps=4   # the CPU demo
# Runs land in OUT_DIR/{exact,jagg,ablate} (default runs/<experiment>/<group>) and the comparison
# (python -m train.compare) in OUT_DIR/compare. GROUP names the wandb group (default
# <experiment>-cmp-<date>). MODES overrides the list (e.g. MODES="exact jagg"). Paths: see common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[[ $# -ge 1 ]] || die "usage: $0 EXPERIMENT [hydra overrides...]"
experiment="$1"
shift
group="${GROUP:-$experiment-cmp-$(date +%Y%m%d-%H%M%S)}"
out_dir="${OUT_DIR:-runs/$experiment/$group}"
read -r -a modes <<< "${MODES:-exact jagg ablate}"
run_dirs=()
for mode in "${modes[@]}"; do
    launch train "$experiment" "$out_dir/$mode" "update=$mode" "logging.group=$group" "$@"
    run_dirs+=("$out_dir/$mode")
done
run_cmd "${PYTHON:-python}" -m train.compare "${run_dirs[@]}" --labels "$(IFS=,; echo "${modes[*]}")" \
    --out "$out_dir/compare"
