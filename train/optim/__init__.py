"""The optimization parts of a run beside the optimizer: the EMA of the trained weights."""
