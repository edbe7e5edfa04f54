"""The trainer's configuration: the typed settings every run part reads (schema.py) and the keys of the tree
(keys.py: a group's error named by its key, moved keys, the settings a checkpoint records); the rules across
groups are the assembly's (train/run/checks.py)."""
