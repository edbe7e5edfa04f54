# Shared by the launchers in this folder (sourced, not run). Paths come from the environment so that
# one set of exports serves every experiment:
#
#   FLUX_PATH, QWENIMAGE_PATH        local diffusers folders of FLUX.1-dev / Qwen-Image
#   TRAIN_PROMPTS                    training prompts, one per line (HPDv2 train split)
#   EVAL_PROMPTS                     optional: evaluation prompts (HPSv2 benchmark jsonl)
#   HPS_CKPT                         HPS_v2.1_compressed.pt
#   CLIP_PATH                        clip-vit-large-patch14 folder (CLIPScore)
#   PICKSCORE_PATH, PICKSCORE_PROCESSOR   PickScore_v1 and its CLIP-H processor (evaluation)
#
# Launch layout (torchrun): NPROC_PER_NODE processes per node (default 8, one per GPU); NNODES > 1
# adds a static rendezvous that needs NODE_RANK, MASTER_ADDR (MASTER_PORT, default 29500) and an
# explicit RUN_DIR on a filesystem every node shares. DRY_RUN=1 prints the commands instead.
# Commands run from the repository root: relative paths (RUN_DIR, OUT_DIR, prompts) start there.

set -euo pipefail

LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$LAUNCH_DIR/../.." && pwd)"
cd "$REPO_ROOT"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
NNODES="${NNODES:-1}"
TORCHRUN="${TORCHRUN:-torchrun}"

die() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

require() {  # require VAR...: every named variable must be set and non-empty
    local name
    for name in "$@"; do
        [[ -n "${!name:-}" ]] || die "set $name (scripts/launch/common.sh lists the variables)"
    done
}

run_cmd() {
    if [[ -n "${DRY_RUN:-}" ]]; then
        printf '%q ' "$@"
        echo
    else
        "$@"
    fi
}

# The Hydra overrides naming the local files of an experiment (none for the CPU demo).
experiment_paths() {
    local experiment="$1" model_var
    case "$experiment" in
        flux_*) model_var=FLUX_PATH ;;
        qwenimage_*) model_var=QWENIMAGE_PATH ;;
        demo | tiny) return 0 ;;
        *) die "unknown experiment '$experiment': pick one of configs/experiment/*.yaml" ;;
    esac
    require "$model_var" TRAIN_PROMPTS HPS_CKPT CLIP_PATH PICKSCORE_PATH PICKSCORE_PROCESSOR
    PATH_OVERRIDES=(
        "model.path=${!model_var}"
        "data.train_prompts=$TRAIN_PROMPTS"
        "reward.components.hpsv2.checkpoint=$HPS_CKPT"
        "reward.components.clipscore.model_path=$CLIP_PATH"
        "eval.scorers.pickscore.model_path=$PICKSCORE_PATH"
        "eval.scorers.pickscore.processor_path=$PICKSCORE_PROCESSOR"
    )
    if [[ -n "${EVAL_PROMPTS:-}" ]]; then
        PATH_OVERRIDES+=("data.eval_prompts=$EVAL_PROMPTS")
    fi
}

# launch MODULE EXPERIMENT RUN_DIR [hydra overrides...]: torchrun on this node (one of NNODES).
launch() {
    local module="$1" experiment="$2" run_dir="$3"
    shift 3
    PATH_OVERRIDES=()
    experiment_paths "$experiment"
    local rendezvous=(--standalone)
    if (( NNODES > 1 )); then
        require NODE_RANK MASTER_ADDR RUN_DIR
        rendezvous=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR"
            --master_port "${MASTER_PORT:-29500}")
    fi
    # hydra.run.dir is passed explicitly: Hydra's default folder is a timestamp taken per process.
    run_cmd "$TORCHRUN" "${rendezvous[@]}" --nproc_per_node "$NPROC_PER_NODE" -m "$module" \
        "experiment=$experiment" "hydra.run.dir=$run_dir" ${PATH_OVERRIDES[@]+"${PATH_OVERRIDES[@]}"} "$@"
}

# The run folder: RUN_DIR when set, else runs/<experiment>/<tag>_<date>.
run_dir_for() {
    echo "${RUN_DIR:-runs/$1/$2_$(date +%Y-%m-%d_%H-%M-%S)}"
}
