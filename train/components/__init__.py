"""The trainer's configuration schema (config.py): the typed settings every run part reads.
Imports train.algorithm and train.distributed, never the trainer or a command."""
