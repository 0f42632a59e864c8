"""staleopt: simulate asynchronous pipeline-parallel training (stale weights) exactly, on one process.

    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     stages=4, schedule="pipemare")

One's own model and data through sweeps, tables, figures and claims (docs/tutorial.md)::

    result = staleopt.compare(my_model, my_data, methods=["gpipe", "pipemare"], stages=[2, "max"], seeds=[0, 1])
"""
from . import corrections, methods, schedules
from .advisor import advise
from .compare import Comparison, compare
from .data import register as register_data
from .models import register as register_model
from .errors import StaleoptError
from .optimizer import PipelineOptimizer
from .partition import Partition, partition_model

__all__ = ["PipelineOptimizer", "Partition", "partition_model", "advise", "schedules", "methods", "corrections",
           "StaleoptError", "compare", "Comparison", "register_model", "register_data"]
__version__ = "0.1.0"
