"""Plug-in corrections against staleness (DESIGN §3), one module each; they compose in a list."""
from .base import Correction
from .stashing import Stashing

__all__ = ["Correction", "Stashing"]
