"""Evaluation: the protocol (fixed prompts and noise, scored with standard errors), the trainer's
evaluator, and the evaluations' tags and console lines (tags.py)."""
