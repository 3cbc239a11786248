"""Find what breaks DistributedDataParallel with ``find_unused_parameters=False`` before a job:
parameters out of the autograd graph on some or all ranks (an if/else branch not taken, LayerDrop,
a head or a MaskedBranch never called), found by running one input per *simulated* rank in this
process, with routing modules tying skipped branches in as under DDP. Findings are grouped by
module; branches of MaskedBranch / ResidualDropPath that no rank sampled are told apart from
unused parameters (they are fine for DDP: run more ranks, do not delete them).

    from maskedbranch.doctor import Inputs, find_divergent_parameters, find_unused_parameters

    print(find_unused_parameters(model, x, mask=m))      # one forward + backward
    report = find_divergent_parameters(model, [(x0,), Inputs(x1, mask=m1), lambda rank: make(rank)])
    report.safe, report.divergent, report.unused, report.not_sampled, report.groups

Command line: ``python -m maskedbranch.doctor MODULE:FACTORY [--ranks K]`` (``--help`` has the
factory contract and an example).
"""
from .cli import main
from .find import find_divergent_parameters, find_unused_parameters
from .rank import Inputs
from .report import Group, ParameterUse, RankFailure, Report, RoutingUse

__all__ = ["Group", "Inputs", "ParameterUse", "RankFailure", "Report", "RoutingUse",
           "find_divergent_parameters", "find_unused_parameters", "main"]
