"""``python -m train.probe``: the command of train/tools/probe/command.py."""

from train.tools.probe.command import command

if __name__ == "__main__":
    command()
