"""Distribution: process groups and cross-rank helpers, the start-up checks and the writes the ranks agree on,
FSDP2 sharding and the global gradient norm, preemption (SIGTERM, Ctrl+C), and every random stream of a run.
Imports nothing else of train/ but the ground."""
