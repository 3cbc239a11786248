"""maskedbranch: conditional computation that trains correctly and fast under
DistributedDataParallel. Every branch's parameters stay in the autograd graph (dead ones get
zero gradients) while the rows a branch does not serve are never computed."""
from . import reference
from ._ops import Plan, WITH_CUDA, anchor, combine, drop_path_scale, gather, make_plan, split_packed

__version__ = "0.1.0"

__all__ = [
    "Plan",
    "WITH_CUDA",
    "anchor",
    "combine",
    "drop_path_scale",
    "gather",
    "make_plan",
    "reference",
    "split_packed",
]
