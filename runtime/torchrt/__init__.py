"""The torch runtime: one decoder (model.py; its layer math in layers.py) over swappable linears
(weights.py), every layout and bf16 checkpoints; the C core attached where it applies (fastpath.py)."""
from .api import LoadedModel, load

__all__ = ["LoadedModel", "load"]
