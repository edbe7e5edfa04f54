"""Comparing training runs (``python -m train.compare``, ``jagg-compare``): arms over seeds, from run folders
and offline or online wandb runs."""
