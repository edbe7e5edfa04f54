"""``python -m train.eval``: the command of train/tools/eval/command.py."""

from train.tools.eval.command import command

if __name__ == "__main__":
    command()
