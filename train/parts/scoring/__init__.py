"""The reward stage of a training step (stage.py): the rollout's chunks decoded and scored as they finish, the
served rewards in the background, and the step's advantages once every score is in. A run part, built once at
start-up (train/run/build.py) from the reward combiner, the backbone's decode and the settings it reads."""
