"""Typed errors: every bad input raises one of these, with a message that says how to fix the call."""

__all__ = ["StaleoptError", "ConfigError", "StageError", "ScheduleError", "DelayError",
           "OptimizerMismatchError", "CorrectionError", "SweepConfigError", "DataError", "StageOrderError",
           "LoopError", "DetachedError", "CheckpointError", "UnsafeCheckpointError", "ClaimLostError",
           "RunFileError", "OutputError", "SharedParameterError", "SegmentError", "RecomputeNotice"]


class StaleoptError(Exception):
    """Base class of every error staleopt raises on purpose."""


class ConfigError(StaleoptError, ValueError):
    """A value is out of range or of the wrong kind."""


class StageError(ConfigError):
    """Bad stage count or cut points for the model at hand."""


class ScheduleError(ConfigError):
    """Unknown schedule or method name, or bad schedule arguments."""


class DelayError(ConfigError):
    """Custom delays that are negative, non-integer or of the wrong length."""


class OptimizerMismatchError(StaleoptError, ValueError):
    """The base optimizer and the model disagree about which parameters exist."""


class CorrectionError(StaleoptError, ValueError):
    """A correction got a bad argument or cannot find the optimizer state it needs."""


class SweepConfigError(ConfigError):
    """A sweep file names a bad key or value."""


class DataError(StaleoptError, RuntimeError):
    """A dataset cannot be found or loaded."""


class StageOrderError(StageError):
    """The stages are not contiguous in the forward pass (modules registered out of execution order)."""


class SharedParameterError(StageError):
    """A trainable parameter is used by more than one stage in a way no replica can serve (one module object
    applied or registered in two stages, a direct read by a later stage; staleopt.replicas), or at all with
    ``shared_parameters="error"``."""


class LoopError(StaleoptError, ValueError):
    """The training loop does something the simulation cannot follow (and says what to do instead)."""


class DetachedError(LoopError):
    """This PipelineOptimizer no longer drives its model: a newer one took over its parameters, a parameter of the
    model was replaced by another ``Parameter``, or ``remove_hooks()`` detached it."""


class SegmentError(LoopError):
    """The ``opt.checkpoint`` calls of a training forward do not match the schedule's recompute segments."""


class RecomputeNotice(UserWarning):
    """``torch.utils.checkpoint`` recomputed a segment under delays: it read the backward view
    (``tau_recomp = tau_bkwd``), not the forward one, so the trajectory differs from the run without it."""


class CheckpointError(StaleoptError, ValueError):
    """A run's checkpoint cannot be used (unreadable, or saved by another configuration)."""


class ClaimLostError(StaleoptError, RuntimeError):
    """Another launch took over this run's claim (its heartbeat was judged too old); this launch stops it."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds objects other than tensors and plain containers: loading it could run code."""


class RunFileError(StaleoptError, ValueError):
    """A run's file (``done``, ``records.csv``, ``config.json``, a claim) is damaged or unreadable; the message
    names the file."""


class OutputError(StaleoptError, OSError):
    """An output file or folder cannot be written (read-only, disk full, or a path outside the output folder)."""
