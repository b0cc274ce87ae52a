"""The torch-free runtime: rows32 artifacts through the C core with numpy only (never imports torch)."""
from .model import LiteModel, load

__all__ = ["LiteModel", "load"]
