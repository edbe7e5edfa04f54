"""The trainer's configuration schema (config.py): the typed settings every run part reads. A run part
like train/run/, train/model/ and the others beside it: it imports train.algorithm, train.distributed and
its fellow run parts, never the trainer or a command."""
