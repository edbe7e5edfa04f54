"""Evaluation: the protocol (fixed prompts and noise, scored with standard errors), the trainer's
evaluator, and the reports (the evaluation lines and the end-of-run summary)."""
