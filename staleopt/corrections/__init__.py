"""Plug-in corrections against staleness (docs/design.md §3), one module each; they compose in a list.

==========================  ======================================  ==============================
correction                  what it changes                         paper
==========================  ======================================  ==============================
Stashing()                  tau_bkwd := tau_fwd                     PipeDream §3.3
LRReschedule(anneal_steps)  per-stage lr / tau^p_k (T1)             PipeMare §3.1 eq. (4)
DiscrepancyCorrection(D)    backward view extrapolated (T2)         PipeMare §3.2
WeightPrediction(rule)      forward view predicted                  PipeOptim §III eqs. (3)-(6)
Warmup(steps)               synchronous first                       PipeMare §4 (PipeMareW)
Hybrid(pipelined_steps)     synchronous after                       Stale-weights paper §4
VerticalSync()              every stage uses stage 0's version      PipeDream §3.3
NesterovLookahead(mu)       NAG look-ahead in the update (SGD)      Ajanthan et al., ICML 2025
RequireNAdam()              checks the base is AsyncPP's NAdam      Ajanthan et al., ICML 2025
DelayCompensation(lam)      g + lam g*g*(w_t - w_stale)             Zheng et al., ICML 2017 §3-4
GapAware()                  g / Gap (staleness in average steps)    Barkai et al., ICLR 2020
StalenessAware()            per-stage lr / tau                      Zhang et al., IJCAI 2016
==========================  ======================================  ==============================
"""
from .base import Correction
from .delay_compensation import DelayCompensation
from .discrepancy import DiscrepancyCorrection
from .gap_aware import GapAware
from .lr_reschedule import LRReschedule, t1_factor
from .nesterov import NesterovLookahead, RequireNAdam
from .phases import Hybrid, Warmup, refill
from .prediction import WeightPrediction
from .stashing import Stashing
from .staleness_aware import StalenessAware
from .vertical_sync import VerticalSync

__all__ = ["Correction", "Stashing", "LRReschedule", "t1_factor", "DiscrepancyCorrection", "WeightPrediction",
           "Warmup", "Hybrid", "refill", "VerticalSync", "NesterovLookahead", "RequireNAdam", "DelayCompensation", "GapAware",
           "StalenessAware"]
