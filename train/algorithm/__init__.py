"""The algorithm: GRPO math, the JAGG update paths, routing of groups to paths, the update stage, and
the gradient-quality measurement (the probe's math). Pure tensor code over a ``predict`` callable;
imports only train.distributed (global reductions)."""
