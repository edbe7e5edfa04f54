"""The reward stage of a training step (stage.py): the chunks of the rollout that the step hands it scored as they
come, the served rewards in the background, and the step's advantages once every score is in. A run part, built
once at start-up by its settings (``RewardStageConfig.build``, train/run/build.py) with the reward combiner."""
