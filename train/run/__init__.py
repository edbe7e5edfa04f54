"""The assembly of a run, above every part it builds: the run built (build.py) into its parts (parts.py), the
folder's lock (folder.py) and timeline (timeline.py), the checks before any model loads (start.py, checks.py,
startup_checks.py). It imports the parts below it, never the trainer or a command."""
