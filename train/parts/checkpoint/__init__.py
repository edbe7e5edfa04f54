"""Checkpoints (save, load, resume checks, rotation) and the export of trained weights."""
