"""A run and its folder: the builders that assemble a run, the run folder's layout and lock, the
resume preflight, the prompt data and the user errors. Imports train.algorithm and
train.distributed, never the trainer or a command."""
