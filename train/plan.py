"""``python -m train.plan``: the command of train/tools/plan/command.py."""

from train.tools.plan.command import command

if __name__ == "__main__":
    command()
