"""The modules that build a run's parts at start-up: the step imports none of them
(tests/unit/test_layers.py) and calls none while it trains (tests/e2e/test_trainer.py)."""

BUILDERS = (
    "train.run.build",
    "train.model.builder",
    "train.model.predict",
    "train.optim.optimizer",
    "train.evaluation.evaluator",
)
