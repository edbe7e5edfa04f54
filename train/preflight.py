"""``python -m train.preflight``: the command of train/tools/preflight/command.py."""

from train.tools.preflight.command import command

if __name__ == "__main__":
    command()
