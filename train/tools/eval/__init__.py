"""The evaluation command (``python -m train.eval``, ``jagg-eval``) over train/parts/eval/protocol.py."""
