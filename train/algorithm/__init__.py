"""The algorithm: GRPO math, the JAGG update paths over segments of W transitions, routing of segments to
paths, the update stage with its settings (and GRPO's and the batch's), and the gradient-quality measurement
(the probe's math). Pure tensor code over a ``predict`` callable: it imports no other package of ``train``
and runs no collective; its metrics carry their reductions (metrics.py) for the caller to reduce over
ranks, and a measurement over ranks takes the caller's ``Ranks`` (quality.py)."""
