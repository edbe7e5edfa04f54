"""``python -m train.compare``: the command of train/compare/command.py."""

import sys

from train.compare.command import main

sys.exit(main())
