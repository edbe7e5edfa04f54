"""Backbone adapters: one file per backbone, found by the registry (see models/registry.py)."""

from models.base import Backbone, Conditioning
from models.registry import backbone_names, get_backbone_class, load_backbone, register_backbone

__all__ = ["Backbone", "Conditioning", "backbone_names", "get_backbone_class", "load_backbone", "register_backbone"]
