"""Compare training runs: ``python scripts/compare_runs.py RUN_DIR... [--out DIR]``, the same as
``python -m train.compare`` (train/compare/command.py documents the tables, the speed-ups and the plots)."""

import sys

from train.compare.command import main

if __name__ == "__main__":
    sys.exit(main())
