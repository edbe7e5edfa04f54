#!/usr/bin/env bash
# Run exact, jagg and ablate of one experiment, one after the other, in one wandb group, then compare:
#   scripts/launch/compare_modes.sh flux_dance [hydra overrides for every run...]
#   SEEDS="0 1 2" scripts/launch/compare_modes.sh flux_dance     # each mode once per seed
#   scripts/launch/compare_modes.sh testbed_compare num_steps=4   # the CPU testbed (one process)
# Runs land in OUT_DIR/<mode> (default runs/<experiment>/<group>), or OUT_DIR/<mode>_s<seed> with SEEDS,
# and the comparison (python -m train.compare, which labels each run from its own config) in
# OUT_DIR/compare. GROUP names the wandb group (default <experiment>-cmp-<date>). MODES overrides the
# list (e.g. MODES="exact jagg"). Paths: see common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[[ $# -ge 1 ]] || die "usage: $0 EXPERIMENT [hydra overrides...]"
experiment="$1"
shift
group="${GROUP:-$experiment-cmp-$(date +%Y%m%d-%H%M%S)}"
out_dir="${OUT_DIR:-runs/$experiment/$group}"
read -r -a modes <<< "${MODES:-exact jagg ablate}"
read -r -a seeds <<< "${SEEDS:-}"
(( ${#seeds[@]} )) || seeds=("")  # no SEEDS: each mode once, with the experiment's own seed
run_dirs=()
for seed in "${seeds[@]}"; do
    for mode in "${modes[@]}"; do
        run_dir="$out_dir/$mode${seed:+_s$seed}"
        launch train "$experiment" "$run_dir" "update=$mode" ${seed:+"seed=$seed"} "logging.group=$group" "$@"
        run_dirs+=("$run_dir")
    done
done
run_cmd "${PYTHON:-python}" -m train.compare "${run_dirs[@]}" --out "$out_dir/compare"
