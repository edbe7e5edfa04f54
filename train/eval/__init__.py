"""The evaluation command (``python -m train.eval``, ``jagg-eval``) over train/components/evaluation.py."""
