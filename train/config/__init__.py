"""The trainer's configuration: the typed settings every run part reads (schema.py), the rules across
their groups (checks.py) and the keys of the tree (keys.py: a group's error named by its key, moved keys,
the settings a checkpoint records). A run part like train/run/, train/model/ and the others beside it: it
imports train.algorithm, train.distributed and its fellow run parts, never the trainer or a command."""
