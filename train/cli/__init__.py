"""What the command-line tools share (``python -m train`` and the commands of train/tools/, with their
``jagg-*`` console scripts): how a command ends, a user's mistake in one line and a bug with its traceback
(reporting.py); the Hydra callback that looks at the run folder before Hydra writes into it (run_folder.py)
and the take-back of what a refused launch wrote (launch.py); ``--help`` from the schema's attribute
docstrings (help_text.py); the schema, resolvers and console format they compose with (compose.py); and the
settings check the launchers of scripts/launch run once before torchrun, which restarts a refused launch
(check.py)."""
