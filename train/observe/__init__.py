"""What a run shows of itself: the logger (console, metrics.jsonl, wandb), performance counters
(timers, FLOPs, MFU, compilation), the statistics they report, and the run's health."""
