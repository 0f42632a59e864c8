"""PipeMare T2: discrepancy correction of the backward (and recompute) weights, PipeMare §3.2, App. B.4, App. D.1."""
from __future__ import annotations

from itertools import chain
from typing import Dict, List, Optional

import torch

from .. import history
from ..errors import CheckpointError, CorrectionError
from ..theory import check_accumulator, t2_gamma
from ..validate import check_int
from .base import Correction

__all__ = ["DiscrepancyCorrection"]


def _blocks(views, new, old, weights):
    """``(views, new, old, weights)`` lists of at most :data:`~staleopt.history.SWAP_BLOCK_BYTES` of ``new`` each
    (a larger tensor alone, cut into flat pieces of that size where ``new`` and ``old`` are contiguous)."""
    cap = history.SWAP_BLOCK_BYTES
    block, size = ([], [], [], []), 0
    for v, n, o, w in zip(views, new, old, weights):
        nbytes = n.numel() * n.element_size()
        if nbytes > cap and n.is_contiguous() and o.is_contiguous():
            step = max(1, cap // n.element_size())
            flat = (v.view(-1), n.view(-1), o.view(-1))
            for a in range(0, n.numel(), step):
                yield tuple([f[a:a + step]] for f in flat) + ([w],)
            continue
        if block[0] and size + nbytes > cap:
            yield block
            block, size = ([], [], [], []), 0
        for lst, x in zip(block, (v, n, o, w)):
            lst.append(x)
        size += nbytes
    if block[0]:
        yield block


class DiscrepancyCorrection(Correction):
    r"""Extrapolate the backward weights towards the forward ones (PipeMare §3.2, T2).

    Where ``tau_fwd_i > tau_bkwd_i``::

        (u_bkwd_t)_i   = w_{t - tau_bkwd_i, i}   - (tau_fwd_i - tau_bkwd_i)   * delta_{s,i}
        (u_recomp_t)_i = w_{t - tau_recomp_i, i} - (tau_fwd_i - tau_recomp_i) * delta_{s',i}   (App. D.1)
        delta_{t+1,i}  = gamma_i * delta_{t,i} + (1 - gamma_i) * (w_{t+1,i} - w_{t,i})
        gamma_i        = D ** (1 / (tau_fwd_i - tau_bkwd_i)),  or 1 - 2/(tau_fwd_i - tau_bkwd_i + 1)
                         for decay="invariant" (App. B.4 eq. 14)

    ``accumulator`` (the names are :data:`staleopt.theory.ACCUMULATORS`, one convention for theory
    and training) says which ``delta`` a view reads:

    * ``"causal"`` (default): the accumulator as it was when that pass ran in the pipeline,
      ``s = t - tau_bkwd_i`` and ``s' = t - tau_recomp_i`` (App. B.4's polynomial). T2 keeps the
      accumulators ``delta_{t-k}`` for ``k`` up to ``max(tau_bkwd_i, tau_recomp_i)`` (the latter
      where ``tau_recomp_i < tau_fwd_i``; largest delays): one weight-sized row per step of that
      depth, only for corrected stages that have one;
    * ``"current"``: ``s = s' = t``, the accumulator at the step that applies the gradient (it
      uses updates a real pipeline does not have yet when the backward pass runs).

    Both agree, bit for bit, where ``tau_bkwd_i = tau_recomp_i = 0`` (every dataflow method).
    ``delta`` starts at 0 (``delta_v = 0`` for ``v < 0``). ``gamma_i`` uses the schedule's
    asynchronous delays (so ``delta`` keeps tracking the weights through a synchronous warmup); the
    correction is applied on the steps whose delays differ. ``w_{t+1} - w_t`` is taken right after the base
    step: a change made at rest after ``step()`` (weight clipping) is in ``w_{t+1}`` but not in ``delta``
    (docs/design.md, T2).
    """

    name, paper = "T2", "PipeMare §3.2, App. B.4, App. D.1"
    rewrites_backward_view = True
    needs_raw_history = True

    def __init__(self, decay, accumulator: str = "causal"):
        if decay != "invariant" and (isinstance(decay, bool) or not isinstance(decay, (int, float))
                                     or not 0.0 < float(decay) < 1.0):
            raise CorrectionError(f"DiscrepancyCorrection(decay) must be a float in (0, 1) (the D of PipeMare "
                                  f"§3.2; the paper sweeps 0.01-0.9) or 'invariant' (App. B.4's "
                                  f"gamma = 1 - 2/(k+1)), got {decay!r}")
        check_accumulator(accumulator, "DiscrepancyCorrection(accumulator)", CorrectionError)
        self.decay = decay if decay == "invariant" else float(decay)
        self.accumulator = accumulator

    def bind(self, engine):
        super().bind(engine)
        tf, tb = engine.max_delays
        tr = engine.max_recompute_delays
        self.gamma = [t2_gamma(self.decay, f, b) if f > b else None for f, b in zip(tf, tb)]
        causal = self.accumulator == "causal"
        #: per corrected view: (rows M, the (M, numel) ring, per row its per-parameter views); delta_v in row v mod M
        self._ring: Dict[int, tuple] = {}
        for i, c in enumerate(engine.chunks):
            if self.gamma[c.stage] is not None:
                s = c.stage  # the recompute view reads delta only where tau_recomp < tau_fwd
                M = 1 + (max(tb[s], tr[s] if tr[s] < tf[s] else 0) if causal else 0)
                p0 = c.params[0]
                ring = torch.zeros((M, c.numel), dtype=p0.dtype, device=p0.device)
                self._ring[i] = (M, ring, [c.split(ring[r]) for r in range(M)])
        self._weights = [1.0 - self.gamma[engine.chunks[i].stage] for i, (_, _, rows) in self._ring.items()
                         for _ in rows[0]]
        self._rewrites: Dict[tuple, tuple] = {}  # (chunks, tau, tau_fwd) -> what _rewrite adds where
        # the factors -(tau_fwd - tau) = 0, -1, .., -max(tau_fwd) as 0-d views of one table per device and dtype of
        # the corrected views: in that dtype where it holds every one exactly (torch's faster same-dtype path),
        # else float64
        K = max(tf)
        self._factors: Dict[tuple, torch.Tensor] = {}
        for i in self._ring:
            p0 = engine.chunks[i].params[0]
            if (p0.device, p0.dtype) not in self._factors:
                exact = torch.arange(0, -(K + 1), -1, dtype=torch.float64)
                same = torch.equal(exact.to(p0.dtype).double(), exact)
                self._factors[(p0.device, p0.dtype)] = exact.to(p0.device, p0.dtype if same else torch.float64)
        self._update: Optional[tuple] = None  # after_update's lists that do not follow the step

    def _delta_at(self, index: int, version: int) -> List[torch.Tensor]:
        """Per-parameter views of view ``index``'s ``delta_version`` (``t - M < version <= t``)."""
        M, _, rows = self._ring[index]
        return rows[version % M]

    def _read(self, index: int, tau: int) -> List[torch.Tensor]:
        """The accumulator a view delayed by ``tau`` reads this step: ``delta_{t-tau}`` (causal) or ``delta_t``."""
        t = self.engine.step_count
        if self.accumulator == "current":
            return self._delta_at(index, t)
        if tau >= self._ring[index][0]:
            raise CorrectionError(f"T2 keeps delta_(t - k) for k < {self._ring[index][0]} at stage "
                                  f"{self.engine.chunks[index].stage} but a view delayed by {tau} reads it: the "
                                  "engine's largest delays (max_delays, max_recompute_delays) must bound every step's "
                                  "(please report this)")
        return self._delta_at(index, t - tau)

    def delta(self, stage: int) -> torch.Tensor:
        """The flat velocity estimate ``delta_t`` of ``stage`` (concatenated over its chunks).

        Raises :class:`~staleopt.errors.CorrectionError` for a stage out of range, or one T2 does not correct
        (``tau_fwd_i = tau_bkwd_i``: no discrepancy, so no ``delta`` is kept).
        """
        stage = check_int("T2 delta(stage): stage", stage, 0, len(self.gamma) - 1, error=CorrectionError)
        if self.gamma[stage] is None:
            tf, tb = self.engine.max_delays
            raise CorrectionError(f"T2 keeps no delta for stage {stage}: its forward and backward delays are equal "
                                  f"(tau_fwd = tau_bkwd = {tf[stage]}), so its backward weights need no correction; "
                                  f"corrected stages: {[i for i, g in enumerate(self.gamma) if g is not None]}")
        t = self.engine.step_count
        return torch.cat([self._ring[i][1][t % self._ring[i][0]] for i, c in enumerate(self.engine.chunks)
                          if c.stage == stage])

    def modifies_backward(self, stage, tau_fwd, tau_bkwd):
        return tau_fwd > tau_bkwd and self.gamma[stage] is not None

    def _rewrite(self, chunks, tau, tf) -> None:
        """``u = w - (tau_fwd - tau) delta_(t - tau)`` for every chunk: one foreach call over all stages,
        ``addcmul_`` with ``-(tau_fwd - tau)`` as a 0-d tensor per tensor (a view of the factor table made
        at :meth:`bind`; the same result as a float64 factor in every dtype, and in float32/float64 as
        ``add_(alpha=...)`` on CPU; the reference engine runs this same code). The factors and the
        accumulators' ring rows are listed once per set of chunks and delays; the views' ``data`` per call
        (the storage the pass reads: a row, or the parameters' own)."""
        key = (tuple([c.index for c in chunks]), tuple(tau), tuple(tf))
        made = self._rewrites.get(key)
        if made is None:
            made = self._rewrites[key] = self._make_rewrite(chunks, tau, tf)
        reads, factors = made
        if not reads:
            return
        data = list(chain.from_iterable([c.data for c in chunks]))
        t = self.engine.step_count
        if self.accumulator == "current":
            deltas = list(chain.from_iterable([rows[t % M] for M, rows, _ in reads]))
        else:
            deltas = list(chain.from_iterable([rows[(t - k) % M] for M, rows, k in reads]))
        torch._foreach_addcmul_(data, deltas, factors)

    def _make_rewrite(self, chunks, tau, tf) -> tuple:
        """``([(M, rows, tau) per chunk], the factor of each tensor)`` of :meth:`_rewrite`."""
        if len(self._rewrites) >= 64:  # random delays (Hogwild) draw ever new ones
            self._rewrites.clear()
        reads, factors = [], []
        for c in chunks:
            self._read(c.index, tau[c.stage])  # (checks that the ring keeps delta_(t - tau))
            M, _, rows = self._ring[c.index]
            reads.append((M, rows, tau[c.stage]))
            p0 = c.params[0]
            factors += [self._factors[(p0.device, p0.dtype)][tf[c.stage] - tau[c.stage]]] * len(c.data)
        return reads, factors

    def backward_view(self, chunks, delays):
        self._rewrite(chunks, delays[1], delays[0])

    def modifies_recompute(self, stage, tau_fwd, tau_recomp):
        return tau_fwd > tau_recomp and self.gamma[stage] is not None

    def recompute_view(self, chunks, delays, tau_recomp):
        """``u_recomp = w_{t - tau_recomp} - (tau_fwd - tau_recomp) delta`` (PipeMare App. D.1)."""
        self._rewrite(chunks, tau_recomp, delays[0])

    def after_update(self, chunks, delays, step):
        """``delta_{t+1} = delta_t + (1 - gamma) ((w_{t+1} - w_t) - delta_t)``, one foreach call over all
        corrected stages (written over ``delta_t`` in place, or into the ring row of ``delta_{t+1-M}``)."""
        if not self._ring:
            return
        if self._update is None:
            chunks = [self.engine.chunks[i] for i in self._ring]
            new = [d for c in chunks for d in c.data]  # w_{t+1}
            small = sum(d.numel() * d.element_size() for d in new) <= history.SWAP_BLOCK_BYTES
            rings = list(self._ring.values())
            # every accumulator in a ring of one row (tau_bkwd = tau_recomp = 0: the dataflow methods): fixed views
            fixed = list(chain.from_iterable([rows[0] for _, _, rows in rings])) if all(M == 1 for M, _, _ in rings) \
                else None
            self._update = (chunks, new, rings, small, fixed)
        chunks, new, rings, small, views = self._update
        old = list(chain.from_iterable([c.stored(step) for c in chunks]))  # w_t
        if views is None:
            dst = list(chain.from_iterable([rows[(step + 1) % M] for M, _, rows in rings if M > 1]))
            if dst:
                torch._foreach_copy_(dst, list(chain.from_iterable([rows[step % M] for M, _, rows in rings if M > 1])))
            views = list(chain.from_iterable([rows[(step + 1) % M] for M, _, rows in rings]))
        # w_{t+1} - w_t is a temporary: block by block (at most SWAP_BLOCK_BYTES, a larger contiguous
        # tensor in flat pieces), so the peak does not grow with the model
        if small:
            torch._foreach_lerp_(views, torch._foreach_sub(new, old), self._weights)
            return
        for block in _blocks(views, new, old, self._weights):
            torch._foreach_lerp_(block[0], torch._foreach_sub(block[1], block[2]), block[3])

    def state_dict(self):
        t = self.engine.step_count
        state = {"delta": {i: ring[t % M] for i, (M, ring, _) in self._ring.items()}}
        rings = {i: ring for i, (M, ring, _) in self._ring.items() if M > 1}
        if rings:
            state["rings"] = rings
        return state

    def load_state_dict(self, state):
        """``delta`` alone (a checkpoint of an engine before the causal accumulator) loads where T2 keeps no
        past accumulators; a stage that needs them raises :class:`~staleopt.errors.CheckpointError`."""
        self.check_state_dict(state)
        deltas = {int(i): flat for i, flat in state["delta"].items()}
        rings = {int(i): ring for i, ring in state.get("rings", {}).items()}
        for i, (M, ring, _) in self._ring.items():
            if M == 1:
                ring[0].copy_(deltas[i])
            else:
                ring.copy_(rings[i])

    def check_state_dict(self, state):
        rings = {int(i) for i in state.get("rings", {})}
        for i, (M, _, _) in self._ring.items():
            if M > 1 and i not in rings:
                raise CheckpointError(f"this checkpoint keeps only T2's current accumulator delta_t, but stage "
                                      f"{self.engine.chunks[i].stage} reads delta_(t - tau) for tau up to {M - 1} "
                                      f"(accumulator='causal', tau_bkwd or tau_recomp > 0): continue it with "
                                      f"DiscrepancyCorrection({self.decay!r}, accumulator='current'), the "
                                      f"convention it was trained with, or restart the run")

    def extra_bytes(self):
        return (sum(ring.numel() * ring.element_size() for _, ring, _ in self._ring.values())
                + sum(f.numel() * f.element_size() for f in self._factors.values()))

    def __repr__(self):
        extra = "" if self.accumulator == "causal" else f", accumulator={self.accumulator!r}"
        return f"DiscrepancyCorrection(decay={self.decay!r}{extra})"
