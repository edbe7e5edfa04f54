"""Run components: the configuration schema, prompt data, checkpoints and the export, the logger, the
EMA, evaluation, the end-of-run summary, the statistics they report, and the builders of a run.
Imports train.algorithm and train.distributed, never the trainer or a command."""
