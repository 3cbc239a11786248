"""maskedbranch: conditional computation that trains correctly and fast under data-parallel
training. Every branch's parameters stay in the autograd graph (dead ones get a gradient anyway)
while the rows a branch does not serve are never computed."""
from . import reference
from ._ops import WITH_CUDA, Plan, make_plan
from .functional import combine, gather, tie
from .nn import MaskedBranch, masked_branch
from .drop_path import DropPath, StochasticDepth, drop_path, stochastic_depth
from .residual import ResidualDropPath, drop_add_residual
from .unused_grads import UnusedGradsToNone, unused_grads_to_none

__version__ = "0.2.0"

__all__ = [
    "DropPath",
    "MaskedBranch",
    "Plan",
    "ResidualDropPath",
    "StochasticDepth",
    "UnusedGradsToNone",
    "WITH_CUDA",
    "combine",
    "drop_add_residual",
    "drop_path",
    "find_divergent_parameters",
    "find_unused_parameters",
    "gather",
    "make_plan",
    "masked_branch",
    "reference",
    "stochastic_depth",
    "tie",
    "unused_grads_to_none",
]


def __getattr__(name):
    # The doctor (a diagnostic tool, with its command line) loads on first use only.
    if name in ("doctor", "find_divergent_parameters", "find_unused_parameters"):
        import importlib

        doctor = importlib.import_module(".doctor", __name__)
        return doctor if name == "doctor" else getattr(doctor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
