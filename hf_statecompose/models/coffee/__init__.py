"""COFFEE (arXiv 2510.14027): the state-feedback selective SSM mixer, parallel by Newton / DEER (:mod:`.mixer`)."""
from .mixer import CoffeeMixer, CoffeeSolveInfo

__all__ = ["CoffeeMixer", "CoffeeSolveInfo"]
