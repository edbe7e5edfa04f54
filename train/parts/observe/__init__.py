"""What a run shows of itself: the logger (metrics.jsonl, wandb), the image grids (grid.py), the console,
performance counters (timers, FLOPs, MFU, compilation), the statistics they report, and the run's health."""
