"""Automatic freeze: end the uncompressed warmup when the variance has settled.

1-bit Adam and 1-bit LAMB freeze Adam's variance ``v`` after ``freeze_step`` steps, 0/1 Adam after
``var_freeze_step``; from then on every coordinate's step size is ``lr / (sqrt(v̂) + eps)`` with
that frozen ``v̂``. Freeze too early and ``v̂`` is still dominated by the first, large gradients
of a run (the denominators are too large, training crawls) or has not seen enough gradients to be
an estimate at all (0/1 Adam then diverges); freeze too late and the warmup's full-precision
all-reduce eats the bandwidth the method exists to save. The published guidance ("15-25% of the
run") came from long pre-training runs and is wrong in both directions for fine-tuning.

The rule
--------
Write ``r_p(k) = sqrt(mean(v̂_p))`` for the RMS-gradient estimate of parameter tensor ``p`` after
``k`` variance updates (``v̂ = v / (1 - β2^k)``, bias-corrected whatever the optimizer's own
``bias_correction``: without it ``v`` grows like ``1 - β2^k`` and never looks settled). Every
``window`` updates the rule compares each tensor's estimate with the one ``window`` updates ago::

    drift(k) = median_p | ln r_p(k) - ln r_p(k - window) |

and freezes at the first check with ``drift <= tolerance`` and ``step >= min_step``, or at
``max_step`` whatever the drift. While ``t`` is small against ``1/(1-β2)``, ``v̂`` is close to the
plain mean of the squared gradients seen so far, so over a window it moves by about
``(window / k)·(ḡ²_recent / v̂ - 1) / 2`` in the log: the drift falls like ``1/k`` when the
gradient scale is steady and stays high while it is still falling (the loss dropping quickly at
the start of fine-tuning). So the rule waits out the initial transient and then freezes once
``window/k`` times the remaining trend is within the tolerance: a variance estimate that the
next ``window`` steps would change by less than ``tolerance`` (5% by default) on a typical
tensor. The median is over tensors, unweighted: the compressor's error and the mask work per
tensor, and a few tensors with noisy estimates (a classifier bias) must not hold the whole
model in warmup.

Every input is identical on every rank during the warmup (the variance is built from the
averaged gradient, bitwise the same everywhere), and the arithmetic is the same, so every rank
picks the same step with no communication. The per-tensor estimates of the last check and the
chosen step are saved in ``state_dict()["onebit"]``: a resumed run continues the same
comparison, and once a step is chosen it never decides again.

Cost: one fused ``_foreach_norm`` over the variance tensors and one host sync every ``window``
steps of the warmup; nothing after the freeze.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger("hf_onebit")

#: the fewest variance updates :meth:`AutoFreeze.for_run` lets a run freeze after, where its 40%
#: bound allows (see there)
MIN_UPDATES = 20


@dataclass
class AutoFreeze:
    """Choose the freeze step from the variance itself (``freeze_step=AutoFreeze(...)`` or ``"auto"``).

    Args:
        min_step: never freeze before this step (the rule needs some updates to compare).
        max_step: always freeze at this step at the latest (``None``: no bound). The HF
            integration and the recipes set it from the run's length.
        window: variance updates between two checks; the drift compares estimates this many
            updates apart.
        tolerance: largest median relative change (in ``ln``) of the per-tensor RMS-gradient
            estimates over one window at which the variance counts as settled.
    """

    min_step: int = 100
    max_step: int | None = None
    window: int = 20
    tolerance: float = 0.05
    # The decision and its working state (not constructor arguments: a copy starts afresh).
    #: the chosen step, once chosen (saved in checkpoints)
    chosen: int | None = field(default=None, init=False, compare=False)
    #: why it was chosen: the drift at that check, or ``None`` when ``max_step`` forced it
    chosen_drift: float | None = field(default=None, init=False, compare=False)
    _reference: list[float] | None = field(default=None, init=False, repr=False, compare=False)
    _reference_update: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("min_step", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AutoFreeze.{name} must be an integer >= 1, got {value!r}")
        if self.max_step is not None:
            if isinstance(self.max_step, bool) or not isinstance(self.max_step, int) or self.max_step < self.min_step:
                raise ValueError(
                    f"AutoFreeze.max_step must be an integer >= min_step ({self.min_step}) or None, got {self.max_step!r}"
                )
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance > 0 and math.isfinite(self.tolerance)):
            raise ValueError(f"AutoFreeze.tolerance must be a positive number, got {self.tolerance!r}")

    @classmethod
    def coerce(cls, value, name: str) -> "AutoFreeze | None":
        """``"auto"`` -> ``AutoFreeze()``; an ``AutoFreeze`` as is; an integer -> ``None`` (fixed step)."""
        if isinstance(value, AutoFreeze):
            return dataclasses.replace(value)  # the optimizer's own copy: one instance may configure several
        if isinstance(value, str):
            if value.strip().lower() == "auto":
                return cls()
            raise ValueError(f"{name} must be an integer >= 1 or 'auto', got {value!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 1 or 'auto', got {value!r}")
        if value == 0:  # v = 0 would be frozen: steps of m/eps, and auto_mask would mask everything
            raise ValueError(
                f"{name}=0: without a warmup step Adam's variance is never estimated, so it would be frozen"
                f" at 0 (every step m/eps). Use {name}='auto', or about 15-25% of the run")
        return None

    @classmethod
    def for_run(cls, total_steps: int) -> "AutoFreeze":
        """Bounds for a run of known length: freeze within [10%, 40%] of it, but not before
        :data:`MIN_UPDATES` steps where 40% allows; checks every 4%.

        The window scales with the run, so a long run compares estimates far enough apart to see
        a slow trend. 10% at least: before it fine-tuning is still in its initial transient
        (docs/algorithms.md, "Automatic freeze"). In a short run 10% is also too few squared
        gradients for a variance that is then used for the rest of the run: after ``k`` of them
        ``v̂`` is about their plain mean, whose per-coordinate relative error is ``sqrt(2/k)``
        for Gaussian gradients (45% at ``k`` = 10, 32% at 20), and every later step's size
        inherits it. 40% at most bounds the price of a late freeze: the whole run then sends
        ``1 / (f + (1 - f)/32)`` = 2.4x fewer bytes than an fp32 all-reduce at ``f`` = 40%, 4.4x
        at 20% (full-precision warmup; 8-bit warmups send 3.6x fewer).
        """
        total = max(1, int(total_steps))
        hi = max(1, round(0.40 * total))
        lo = min(hi, max(MIN_UPDATES, round(0.10 * total)))
        return cls(min_step=lo, max_step=hi, window=max(1, round(0.04 * total)))

    def fit_to_run(self, total_steps: int) -> bool:
        """Take :meth:`for_run`'s bounds if this rule still has the plain ``"auto"`` settings.

        Returns whether it changed anything. Bounds the user chose are kept; so is a decision.
        """
        if self.chosen is not None or self != AutoFreeze():
            return False
        fitted = AutoFreeze.for_run(total_steps)
        self.min_step, self.max_step, self.window = fitted.min_step, fitted.max_step, fitted.window
        return True

    # ---------------------------------------------------------------- the decision
    def observe(self, step: int, updates: int, variances: list[tuple[torch.Tensor, float]],
                sum_over_shards: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
        """Called after a variance update; True when the warmup should end with this step.

        ``updates`` counts the variance updates so far (``k``); ``variances`` lists each tensor's
        ``v`` with its ``β2``. Decides once; after that always answers whether ``step`` is the
        chosen step. ``sum_over_shards``: where each ``v`` is one rank's shard of a tensor (FSDP2),
        sums the per-tensor sums and sizes over the ranks holding its other shards, so every rank
        judges the whole tensors and picks the same step.
        """
        if self.chosen is not None:
            return step == self.chosen
        if self.max_step is not None and step >= self.max_step:
            return self._choose(step, None, updates)
        if updates < 1 or updates % self.window or updates == self._reference_update:
            return False  # not a check, or this update count was checked already (0/1 Adam's 1-bit steps)
        estimates = _rms_estimates(variances, updates, sum_over_shards)
        previous, self._reference, prev_update = self._reference, estimates, self._reference_update
        self._reference_update = updates
        if previous is None or len(previous) != len(estimates) or updates - prev_update != self.window:
            return False
        drifts = [abs(math.log(a / b)) for a, b in zip(estimates, previous) if a > 0 and b > 0]
        if not drifts:
            return False
        drift = _median(drifts)
        if step >= self.min_step and drift <= self.tolerance:
            return self._choose(step, drift, updates)
        return False

    def _choose(self, step: int, drift: float | None, updates: int) -> bool:
        self.chosen, self.chosen_drift = step, drift
        self._reference = None
        return True

    def describe(self) -> str:
        """One line for the log: the chosen step and why."""
        bounds = f"bounds [{self.min_step}, {self.max_step if self.max_step is not None else 'none'}]"
        if self.chosen is None:
            return (f"auto freeze: not chosen yet ({bounds}, a check every {self.window} variance updates,"
                    f" tolerance {100 * self.tolerance:.1f}%)")
        if self.chosen_drift is None:
            return f"auto freeze chose step {self.chosen}: max_step reached before the variance settled ({bounds})"
        return (
            f"auto freeze chose step {self.chosen}: the per-tensor RMS gradients moved by {100 * self.chosen_drift:.1f}%"
            f" (median) over the last {self.window} variance updates, within the tolerance of"
            f" {100 * self.tolerance:.1f}% ({bounds})"
        )

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "min_step": self.min_step, "max_step": self.max_step, "window": self.window,
            "tolerance": self.tolerance, "chosen": self.chosen, "chosen_drift": self.chosen_drift,
            "reference": list(self._reference) if self._reference is not None else None,
            "reference_update": self._reference_update,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the decision and the last check. A chosen step is kept whatever the bounds now."""
        self.chosen = None if state.get("chosen") is None else int(state["chosen"])
        drift = state.get("chosen_drift")
        self.chosen_drift = None if drift is None else float(drift)
        ref = state.get("reference")
        self._reference = None if ref is None else [float(x) for x in ref]
        self._reference_update = int(state.get("reference_update", 0))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _rms_estimates(variances: list[tuple[torch.Tensor, float]], updates: int,
                   sum_over_shards: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[float]:
    """``sqrt(mean(v / (1 - β2^k)))`` per tensor, with one fused norm and one host sync.

    ``sum_over_shards`` (see :meth:`AutoFreeze.observe`): one all-reduce of the sums and sizes,
    and no empty tensor left out (a shard may be empty on one rank and not on another).
    """
    # logical order: a channels_last variance sums (and so freezes) like a contiguous one
    kept = [(v.contiguous(), b2) for v, b2 in variances if v.numel() or sum_over_shards is not None]
    if not kept:
        return []
    sums = torch.stack(torch._foreach_norm([v for v, _ in kept], 1, dtype=torch.float32))  # v >= 0: ‖v‖₁ = Σ v
    sizes = [v.numel() for v, _ in kept]
    if sum_over_shards is not None:
        both = sum_over_shards(torch.cat([sums.double(), torch.tensor(sizes, dtype=torch.float64, device=sums.device)]))
        sums, sizes = both[: len(kept)], [int(n) for n in both[len(kept):].tolist()]
    # β2 in [0, 1) (checked at construction) and updates >= 1, so 1 - β2^k > 0
    return [math.sqrt(s / n / (1 - b2**updates)) for s, n, (_, b2) in zip(sums.tolist(), sizes, kept) if n]


#: The latest automatic freeze of a run whose length nobody gave (:meth:`FreezeSchedule.fit_to_run`).
DEFAULT_MAX_STEP = 1000


def run_length(scheduler) -> int | None:
    """The number of steps a learning-rate scheduler plans for, or ``None`` if it does not say.

    Read from torch's ``OneCycleLR`` (``total_steps``), ``CosineAnnealingLR`` (``T_max``),
    ``PolynomialLR`` (``total_iters``), ``SequentialLR`` (its last milestone plus its last
    scheduler's length) and the ``LambdaLR`` of transformers' ``get_*_schedule_with_warmup``
    (their ``num_training_steps``).
    """
    for attribute in ("total_steps", "T_max"):
        value = getattr(scheduler, attribute, None)
        if isinstance(value, int) and value > 0:
            return value
    if type(scheduler).__name__ == "PolynomialLR":
        return int(scheduler.total_iters)
    if type(scheduler).__name__ == "SequentialLR":
        last = run_length(scheduler._schedulers[-1])
        return None if last is None else int(scheduler._milestones[-1]) + last
    for fn in getattr(scheduler, "lr_lambdas", ()):
        value = getattr(fn, "keywords", {}).get("num_training_steps")  # a functools.partial
        if isinstance(value, int) and value > 0:
            return value
    return None


#: What the freeze step reads as while an automatic freeze has not chosen yet: a step no run
#: reaches, so every ``t <= freeze_step`` test keeps answering "warmup".
UNDECIDED = 2**62

#: Warn when a variance frozen without bias correction makes the first steps after the freeze
#: more than this many times larger than Adam's (``1 / sqrt(1 - β2**k)`` after ``k`` updates).
#: It lets through DeepSpeed's own 0/1 Adam defaults (201 variance updates in 100k steps: 2.3x
#: with β2 = 0.999) and catches the short variance phases of fine-tuning runs (44 updates: 4.8x;
#: 16: 7.9x), whose oversized first steps cost accuracy or diverge.
UNCORRECTED_STEP_LIMIT = 3.0


class FreezeSchedule:
    """Mixin for the optimizers with a warmup: the last warmup step, fixed or chosen automatically.

    The subclass calls :meth:`init_freeze` in its constructor, :meth:`observe_variance` after
    each variance update, and reads :attr:`warmup_end` (exposed under its own name:
    ``freeze_step`` or ``var_freeze_step``).
    """

    auto_freeze: AutoFreeze | None = None
    _fixed_warmup_end: int = 0
    _freeze_name: str = "freeze_step"

    def init_freeze(self, value, name: str, total_steps: int | None = None) -> None:
        """``value``: an integer >= 1, ``"auto"`` or an :class:`AutoFreeze`; ``name`` its keyword;
        ``total_steps``: the run's length, if known (see :meth:`fit_to_run`)."""
        self.auto_freeze = AutoFreeze.coerce(value, name)
        self._fixed_warmup_end = 0 if self.auto_freeze is not None else int(value)
        self._freeze_name = name
        if total_steps is not None:
            self.fit_to_run(total_steps)

    def fit_to_run(self, run) -> bool:
        """Fit a plain ``"auto"`` freeze's bounds to the run's length (:meth:`AutoFreeze.for_run`).

        ``run``: the number of optimizer steps, or the run's learning-rate scheduler (whose length
        :func:`run_length` reads). Returns whether the bounds changed: a fixed freeze step, bounds
        the user chose and a decision already taken are kept. The HF integration calls it when
        training starts; without it, the first step bounds the freeze at :data:`DEFAULT_MAX_STEP`.
        """
        total = run if isinstance(run, int) and not isinstance(run, bool) else run_length(run)
        if total is None:
            raise ValueError(
                f"fit_to_run: cannot read a run length from {type(run).__name__}; pass the number of steps"
                " (torch's OneCycleLR, CosineAnnealingLR, PolynomialLR, SequentialLR and transformers'"
                " get_*_schedule_with_warmup are read)")
        if total < 1:
            raise ValueError(f"fit_to_run: the run must have at least one step, got {total}")
        return self.auto_freeze is not None and self.auto_freeze.fit_to_run(total)

    @property
    def warmup_end(self) -> int:
        """The last warmup step: the fixed one, the chosen one, or :data:`UNDECIDED`."""
        if self.auto_freeze is None:
            return self._fixed_warmup_end
        return UNDECIDED if self.auto_freeze.chosen is None else self.auto_freeze.chosen

    def _variance_tensors(self) -> list[tuple[torch.Tensor, float]]:
        return [
            (self.state[p]["exp_avg_sq"], group["betas"][1])
            for group in self.param_groups for p in group["params"]
            if "exp_avg_sq" in self.state.get(p, {})
        ]

    def observe_variance(self, step: int, updates: int) -> None:
        """After a variance update at ``step`` (``updates`` so far): let the automatic freeze decide."""
        auto = self.auto_freeze
        if auto is None or auto.chosen is not None:
            return
        if auto.max_step is None:  # nobody told it the run's length: end within a bound all the same
            auto.max_step = max(auto.min_step, DEFAULT_MAX_STEP)
            if self.rank == 0:
                logger.info(
                    "hf_onebit %s: %s='auto' without the run's length: the warmup ends by step %d at the latest."
                    " Pass total_steps=N to the constructor or call optimizer.fit_to_run(N or lr_scheduler)"
                    " to fit it to the run", type(self).__name__, self._freeze_name, auto.max_step)
        shards = self.hook_state.sum_over_shards if self.hook_state is not None and self.hook_state.sharded else None
        if auto.observe(step, updates, self._variance_tensors(), shards) and self.rank == 0:
            logger.info("hf_onebit %s: %s; %s=%d", type(self).__name__, auto.describe(), self._freeze_name, step)

    def warn_uncorrected_variance(self, beta2: float, updates: int | None = None) -> None:
        """Warn at construction when a variance frozen without bias correction is known to be unstable.

        After ``k`` updates an uncorrected ``v`` is ``1 - β2**k`` of its stationary value, so
        steps are ``1/sqrt(1 - β2**k)`` times Adam's (3.2x after 100 updates with β2 = 0.999;
        7.9x after 16, enough to diverge). It warns above :data:`UNCORRECTED_STEP_LIMIT`.
        ``updates``: the number of variance updates before the freeze (default: the freeze step).
        """
        if self.auto_freeze is not None:
            k = self.auto_freeze.min_step if updates is None else updates
        else:
            k = self._fixed_warmup_end if updates is None else updates
        factor = math.inf if k <= 0 or 1 - beta2**k <= 0 else 1 / math.sqrt(1 - beta2**k)
        if factor > UNCORRECTED_STEP_LIMIT:
            logger.warning(
                "hf_onebit %s: bias_correction=False with beta2=%s and the variance frozen after %d update(s):"
                " the first steps after the freeze are %.1fx larger than Adam's, which is known to lose accuracy or diverge."
                " Fix: bias_correction=True (or beta2 <= %.4g for this freeze).",
                type(self).__name__, beta2, k, factor, (1 - UNCORRECTED_STEP_LIMIT**-2) ** (1 / max(k, 1)),
            )

    # ---------------------------------------------------------------- state
    def global_state(self) -> dict:
        state = {**super().global_state(), self._freeze_name: self.warmup_end if self.warmup_end != UNDECIDED else None}
        if self.auto_freeze is not None:
            state["auto_freeze"] = self.auto_freeze.state_dict()
        return state

    def load_global_state(self, state: dict) -> None:
        super().load_global_state(state)
        auto = self.auto_freeze
        if auto is None:
            return
        if state.get("auto_freeze") is not None:
            auto.load_state_dict(state["auto_freeze"])
        elif state.get(self._freeze_name) is not None and self.steps_done > int(state[self._freeze_name]):
            # A checkpoint of a fixed freeze that already froze: keep its step, decide nothing.
            auto.chosen = int(state[self._freeze_name])
        if auto.chosen is not None and self.rank == 0:
            logger.info("hf_onebit %s: restored %s", type(self).__name__, auto.describe())
