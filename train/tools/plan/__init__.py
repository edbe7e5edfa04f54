"""The memory planner (``python -m train.plan``, ``jagg-plan``): one full-size training step traced on fake tensors."""
