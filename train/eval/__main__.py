"""``python -m train.eval``: the command of train/eval/command.py."""

from train.eval.command import command

command()
