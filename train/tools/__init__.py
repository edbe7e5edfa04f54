"""The commands beside the trainer, each a package of its own: eval, probe, compare, plan, preflight
(``python -m train.<command>``: the one-line entries train/<command>.py)."""
