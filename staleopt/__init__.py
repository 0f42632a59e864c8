"""staleopt: simulate asynchronous pipeline-parallel training (stale weights) exactly, on one process.

    opt = staleopt.PipelineOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     stages=4, schedule="pipemare")
"""
from . import corrections, methods, schedules
from .advisor import advise
from .errors import StaleoptError
from .optimizer import PipelineOptimizer
from .partition import Partition, partition_model

__all__ = ["PipelineOptimizer", "Partition", "partition_model", "advise", "schedules", "methods", "corrections",
           "StaleoptError"]
__version__ = "0.1.0"
