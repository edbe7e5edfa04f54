"""``python -m train.plan``: the command of train/plan/command.py."""

from train.plan.command import command

command()
