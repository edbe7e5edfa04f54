"""The CPU-scale testbed: a procedural captioned shape set (``testbed.data``) and the tiny
Flux-architecture pipeline pretrained on it (``testbed.pretrain``, ``scripts/pretrain_testbed.py``).
May import models/, samplers/ and rewards/, never train/."""
