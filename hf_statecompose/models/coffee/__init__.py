"""COFFEE (arXiv 2510.14027): the state-feedback selective SSM mixer, parallel by Newton / DEER (:mod:`.mixer`)."""
from .baselines import LinearizedS6Mixer, S6Mixer
from .mixer import CoffeeMixer, CoffeeSolveInfo

__all__ = ["CoffeeMixer", "CoffeeSolveInfo", "LinearizedS6Mixer", "S6Mixer"]
