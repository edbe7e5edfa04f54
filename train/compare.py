"""``python -m train.compare``: the command of train/tools/compare/command.py."""

import sys

from train.tools.compare.command import main

if __name__ == "__main__":
    sys.exit(main())
