"""The optimization parts of a run beside the optimizer: AdamW's settings and the EMA of the trained weights."""
