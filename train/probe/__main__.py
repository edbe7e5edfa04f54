"""``python -m train.probe``: the command of train/probe/command.py."""

from train.probe.command import command

command()
