"""The parallelism planner (`tracetop plan`): ranked TP x PP x DP plans from a model and a cluster.

Arithmetic only (``planner.model``), with a thin command-line edge (``planner.cli``). It imports no
other package of ours: it needs nothing of the wire, the collector or the hooks.
"""

from planner.model import Cluster, PlanError, derive_model, launch_commands, plan, to_dict

__all__ = ["Cluster", "PlanError", "derive_model", "launch_commands", "plan", "to_dict"]
