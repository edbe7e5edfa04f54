"""``python -m train.preflight``: the command of train/preflight/command.py."""

from train.preflight.command import command

command()
