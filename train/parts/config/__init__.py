"""The trainer's configuration: TrainConfig, the tree that composes each group from beside the part that reads it
(schema.py), the keys of the tree (keys.py: a group's error named by its key, moved keys, the settings a
checkpoint records) and what a resume reads of a run folder's past (record.py); the rules across groups are the
assembly's (train/run/checks.py). It stands above the parts whose groups it composes."""
