"""The evaluation command (``python -m train.eval``, ``jagg-eval``) over train/evaluation/protocol.py."""
