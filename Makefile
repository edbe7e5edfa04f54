# The quick start of the README: two commands on a fresh machine with Python 3.10+ (and make).
#   make demo   the default job (GRPO on the CPU testbed, 3 to 5 minutes on 2 cores of its own)
#   make test   the tests (CPU only, tiny models, no network once installed)
# Each creates .venv with the pinned versions on first use (constraints.txt; a few minutes, about
# 6 GB) and reinstalls when setup.py or constraints.txt change. .ci/run calls `make test`.
# On a GPU cluster install into your own environment instead (README, Install).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-fast test-long test-slurm lint install

demo: $(VENV)/.installed
	$(BIN)/python -m train

test: $(VENV)/.installed $(VENV)/.test-extras
	$(BIN)/python -m pytest -q -m "not long and not slurm" tests

# the inner loop: every test but those marked slow (subprocesses, torchrun, long training)
test-fast: $(VENV)/.installed $(VENV)/.test-extras
	$(BIN)/python -m pytest -q -m "not slow and not long and not slurm" tests

# what make test leaves out to keep CI under 20 minutes on 2 cores: the four-process runs (HSDP, the
# two-node rehearsal), the one-rank failure on 2 ranks and the compiled-against-eager tests (inductor
# compiles for minutes)
test-long: $(VENV)/.installed $(VENV)/.test-extras
	$(BIN)/python -m pytest -q -m long tests

# scripts/launch/slurm.sbatch on a real one-node Slurm cluster that the tests start and stop (tests/slurm/, as
# root): installs Debian's slurm-wlm and munge first where they are missing
test-slurm: $(VENV)/.installed
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || { \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; } || { \
			echo "make: test-slurm needs slurm-wlm and munge: run it as root on Debian or Ubuntu, or install them"; exit 1; }; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; }
	$(BIN)/python -m pytest -q -rP -m slurm tests/slurm

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

install: $(VENV)/.installed

$(VENV)/.installed: setup.py constraints.txt
	@$(PYTHON) -c "import sys; sys.exit(sys.version_info < (3, 10))" 2>/dev/null || { \
		echo "make: $(PYTHON) is missing or older than 3.10; name another one: make $(MAKECMDGOALS) PYTHON=python3.11"; exit 1; }
	@$(PYTHON) -m venv $(VENV) || { \
		echo "make: $(PYTHON) -m venv failed; on Debian or Ubuntu install python3-venv first"; exit 1; }
	$(BIN)/python -m pip install -c constraints.txt -e ".[dev]"
	touch $@

# The HPSv2.1 parity test compares against the reference package; it is not a dependency (it pins
# protobuf<4 and pytest 7), so it is installed without its requirements. So is ImageReward's, image-reward
# (it pins timm 0.6 and fairscale, and imports diffusers, datasets and OpenAI's clip for its trainer): its
# model's modules need only timm (open_clip's) and fairscale's checkpoint wrapper, imported by its ViT.
# The remote reward's tests serve a scorer with scripts/reward_server.py: the server extra (FastAPI, uvicorn).
$(VENV)/.test-extras: $(VENV)/.installed
	$(BIN)/python -m pip install --no-deps hpsv2x==1.2.0 clint==0.5.1 args==0.1.0
	$(BIN)/python -m pip install --no-deps image-reward==1.5 fairscale==0.4.13
	$(BIN)/python -m pip install -c constraints.txt -e ".[server]"
	touch $@
