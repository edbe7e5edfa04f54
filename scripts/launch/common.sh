# Shared by the launchers in this folder (sourced, not run). Paths come from the environment so that
# one set of exports serves every experiment:
#
#   FLUX_PATH, QWENIMAGE_PATH        local diffusers folders of FLUX.1-dev / Qwen-Image
#   TRAIN_PROMPTS                    training prompts, one per line (HPDv2 train split)
#   EVAL_PROMPTS                     evaluation prompts: the HPSv2 benchmark jsonl (eval.prompts)
#   HPS_CKPT                         HPS_v2.1_compressed.pt
#   CLIP_PATH                        clip-vit-large-patch14 folder (CLIPScore)
#   PICKSCORE_PATH, PICKSCORE_PROCESSOR   PickScore_v1 and its CLIP-H processor (evaluation)
#
# Launch layout (torchrun): NPROC_PER_NODE processes per node (default 8, one per GPU; 1 for the CPU
# experiments demo, tiny and testbed_compare); NNODES > 1 adds torchrun's c10d rendezvous
# (--nnodes --node_rank --rdzv_backend c10d --rdzv_endpoint MASTER_ADDR:MASTER_PORT, port default
# 29500), which needs NODE_RANK, MASTER_ADDR and an explicit RUN_DIR on a filesystem every node shares.
# Elastic by default: torchrun restarts all workers when one fails, up to MAX_RESTARTS times (default 3;
# MAX_RESTARTS=0 turns it off), and a training launch passes resume=auto (unless you pass a resume=
# of your own), so a restart continues from the run's latest checkpoint: a crash costs the steps since
# that checkpoint (checkpoint.every) plus a model load, not the run. A folder holding a run of other
# settings is still refused. torchrun restarts a failed launch whatever its exit status, so a training
# launch first checks its settings once, in one process (python -m train.cli.check with the same
# overrides, PYTHON the interpreter, default python): a refused setting or a missing file is one line,
# exit status 2, and torchrun does not start (DRY_RUN, and Hydra's flags such as --cfg, skip the check).
# The launchers export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (unless it is set): the restarted workers
# then get a fresh store of their own round; sharing the agents' store, they read the dead workers'
# addresses still in it and gloo failed to connect (measured on 2 nodes).
# PREFLIGHT=1 launches python -m train.preflight in place of the training run, with the same layout and
# overrides and without restarts: the run's checks, machine, collectives, a step at reduced depth and the
# corrected plan, written to <run folder>/preflight.json (docs/preflight.md); set RUN_DIR to check the run's
# own folder. DRY_RUN=1 prints the commands instead of running them; a variable that is not set prints as
# <NAME>, so the commands can be read before any path exists.
# Commands run from the repository root: relative paths (RUN_DIR, OUT_DIR, prompts) start there.

set -euo pipefail

LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$LAUNCH_DIR/../.." && pwd)"
cd "$REPO_ROOT"
NNODES="${NNODES:-1}"
TORCHRUN="${TORCHRUN:-torchrun}"

die() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

require() {  # require VAR...: every named variable must be set and non-empty (DRY_RUN: shown as <VAR>)
    local name
    for name in "$@"; do
        if [[ -z "${!name:-}" ]]; then
            [[ -n "${DRY_RUN:-}" ]] || die "set $name (scripts/launch/common.sh lists the variables)"
            printf -v "$name" '<%s>' "$name"
        fi
    done
}

quote() {  # one argument as a shell reads it back: as it is when that is safe, else in single quotes
    if [[ "$1" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

run_cmd() {
    if [[ -n "${DRY_RUN:-}" ]]; then
        local arg line=()
        for arg in "$@"; do
            line+=("$(quote "$arg")")
        done
        echo "${line[*]}"
    else
        "$@"
    fi
}

# The Hydra overrides naming the local files of an experiment (none for the CPU experiments), and
# its default number of processes per node.
experiment_paths() {
    local experiment="$1" model_var
    [[ -f "configs/experiment/$experiment.yaml" ]] ||
        die "unknown experiment '$experiment': pick one of configs/experiment/*.yaml"
    case "$experiment" in
        flux_*) model_var=FLUX_PATH ;;
        qwenimage_*) model_var=QWENIMAGE_PATH ;;
        *)  # the CPU experiments (demo, tiny, testbed_compare): local files shipped, one process
            DEFAULT_NPROC=1
            return 0
            ;;
    esac
    DEFAULT_NPROC=8
    require "$model_var" TRAIN_PROMPTS EVAL_PROMPTS HPS_CKPT CLIP_PATH PICKSCORE_PATH PICKSCORE_PROCESSOR
    PATH_OVERRIDES=(
        "model.path=${!model_var}"
        "data.train_prompts=$TRAIN_PROMPTS"
        "eval.prompts=$EVAL_PROMPTS"
        "reward.components.hpsv2.checkpoint=$HPS_CKPT"
        "reward.components.clipscore.model_path=$CLIP_PATH"
        "eval.scorers.pickscore.model_path=$PICKSCORE_PATH"
        "eval.scorers.pickscore.processor_path=$PICKSCORE_PROCESSOR"
    )
}

# has_setting NAME [hydra overrides...]: whether an override sets NAME (NAME=, +NAME= or ++NAME=).
has_setting() {
    local name="$1" arg
    shift
    for arg in "$@"; do
        [[ "$arg" =~ ^\+{0,2}$name= ]] && return 0
    done
    return 1
}

# has_flag [args...]: whether an argument is one of Hydra's flags (--cfg, --help, ...): the job then does not train.
has_flag() {
    local arg
    for arg in "$@"; do
        [[ "$arg" == -* ]] && return 0
    done
    return 1
}

# launch MODULE EXPERIMENT RUN_DIR [hydra overrides...]: torchrun on this node (one of NNODES).
launch() {
    local module="$1" experiment="$2" run_dir="$3"
    shift 3
    local resume=() restarts="${MAX_RESTARTS:-3}"
    if [[ "$module" == train ]] && ! has_setting resume "$@"; then
        resume=(resume=auto)
    fi
    if [[ "$module" == train && -n "${PREFLIGHT:-}" ]]; then  # the run's own launch, checked and measured
        module=train.preflight
        restarts=0
    fi
    PATH_OVERRIDES=()
    experiment_paths "$experiment"
    local rendezvous=(--standalone)
    if (( NNODES > 1 )); then
        require NODE_RANK MASTER_ADDR RUN_DIR
        rendezvous=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --rdzv_backend c10d
            --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}")
    fi
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
    # hydra.run.dir is passed explicitly: Hydra's default folder is a timestamp taken per process.
    local settings=("experiment=$experiment" "hydra.run.dir=$run_dir" ${PATH_OVERRIDES[@]+"${PATH_OVERRIDES[@]}"}
        ${resume[@]+"${resume[@]}"} "$@")
    if [[ "$module" == train && -z "${DRY_RUN:-}" ]] && ! has_flag "$@"; then
        # torchrun restarts a failed launch whatever its exit status: a refused setting is said once, here
        "${PYTHON:-python}" -m train.cli.check "${settings[@]}" || exit $?
    fi
    run_cmd "$TORCHRUN" "${rendezvous[@]}" --max-restarts "$restarts" \
        --nproc_per_node "${NPROC_PER_NODE:-$DEFAULT_NPROC}" -m "$module" "${settings[@]}"
}

# The run folder: RUN_DIR when set, else runs/<experiment>/<tag>_<date>.
run_dir_for() {
    echo "${RUN_DIR:-runs/$1/$2_$(date +%Y-%m-%d_%H-%M-%S)}"
}
