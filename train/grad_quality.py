"""``python -m train.grad_quality`` was renamed: the probe is ``python -m train.probe`` (``jagg-probe``)."""

import sys

print("python -m train.grad_quality: renamed to python -m train.probe (console script jagg-probe)", file=sys.stderr)
sys.exit(2)
