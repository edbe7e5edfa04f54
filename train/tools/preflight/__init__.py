"""``python -m train.preflight``: whether a run will work on this cluster, how fast it will go, what to change
(train/tools/preflight/command.py)."""
