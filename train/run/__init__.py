"""A run and its folder: the assembly of a run (build.py) into its parts (parts.py), the run folder's
layout (layout.py) and lock (folder.py), the checks before any model loads (start.py, startup_checks.py,
scorers.py), the prompt data and the user errors. Like every run part it imports train.algorithm,
train.distributed and its fellow run parts, never the trainer or a command."""
