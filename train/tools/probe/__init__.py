"""The gradient-quality probe (``python -m train.probe``, ``jagg-probe``): the paper's Appendix E on a
configured run."""
