"""The defaults of every entry point, in one table: the library's, and the papers' a switch away.

Each optimizer's constructor arguments below default to :data:`LIBRARY`'s value; with
``defaults="paper"`` every argument the caller leaves out takes :data:`PAPER`'s value instead, the
papers' arithmetic (stated in ``docs/algorithms.md``), which the trajectory tests check against
independent simulations. An argument the caller gives is always taken as given. The plain
constructors, :class:`~hf_onebit.OneBitTrainer`, the launcher (``python -m hf_onebit.run``), the
Accelerate plugin and the recipes all build their optimizers through these constructors, so they
share one set of defaults; the training-loop settings that go with them (learning rate, gradient
clipping) are in :mod:`hf_onebit.integrations.defaults`, applied by every HF entry point.

What each library default does, and why it differs from the paper (figures: ``docs/results.md``):

==========================  =====================================================================
argument                    library default
==========================  =====================================================================
``freeze_step``             ``"auto"``: the warmup ends when the variance has settled, within
(0/1 Adam:                  bounds fitted to the run's length (:mod:`hf_onebit.optim.freeze`). The
``var_freeze_step``)        paper's ``100000`` is longer than most runs: they never compress.
``scale_per_tensor``        ``True``: one compression scale per parameter tensor, so a
                            tiny-gradient tensor is not rebuilt at its bucket's scale (a 100-layer
                            stack diverges at the first 1-bit step without it).
``scale_block``             ``256``: each tensor's pieces are cut into blocks of 256 elements, one
                            scale each, as block-wise quantizers do. Under one scale per tensor
                            the coordinates with small gradients (most of an embedding matrix)
                            round to zero for several steps and then arrive in bursts, which
                            inflate Adam's variance and slow them by about the square root of the
                            burst length: fine-tuning stalled in a run of a few dozen steps.
                            Costs 4 bytes of scale per 256 elements; the b-bit warmup's blocks
                            are ``b`` times shorter (32 elements at 8 bits), the same share of
                            its bytes (:func:`hf_onebit.comm.pieces.width_block`).
``update_clip``             ``1.0`` (1-bit LAMB ``1.5``): no coordinate's adaptive step exceeds ``lr``
                            where the variance is stale (after the freeze), so an early freeze cannot
                            blow up a step. 1-bit LAMB's momentum is exchanged in its own units, each
                            coordinate at its block's scale, so a clip at 1.0 cut most coordinates
                            and its step became ``sign(m)`` (``docs/results.md``).
``step_bound``              ``3.0`` (1-bit LAMB): after the freeze no tensor steps more than 3 times
                            as far as LAMB's own trust ratio of the exchanged update would take it:
                            the frozen ratio does not normalize the step as LAMB's does, and from
                            scratch at a large lr single tensors took several times LAMB's step.
``warmup_bits``             ``8``: the warmup (0/1 Adam: its variance steps) exchanges the gradient
                            at 8 bits with error feedback (``docs/algorithms.md``, "Exchanges")
                            instead of 32, so the warmup, which the automatic freeze keeps long,
                            sends 3.6x fewer bytes. Its blocks are 8 times shorter than the
                            1-bit phase's (``scale_block``): at 256 elements its rounding cost a
                            small LM trained from scratch at a large lr several times what it costs
                            at 32 (``docs/results.md``). Where 0/1 Adam has 1-bit gradient steps between
                            its variance steps (a ``var_update_scaler``), the variance steps keep
                            error buffers apart from theirs: a shared pair would hand the 8-bit
                            gradient the variance is built from the 1-bit steps' far larger
                            residual (:mod:`hf_onebit.comm.compressed`).
``bias_correction``         ``True`` (1-bit LAMB): LAMB on Adam's bias-corrected moments, as
                            uncompressed LAMB implementations run it; the trust-ratio average
                            starts at the first ratio. The paper's uncorrected moments leave a
                            short run's frozen variance far below its settled value, so the update
                            clip cuts most coordinates and the factor falls to ``factor_min``.
``momentum_correction``     ``True`` (0/1 Adam): every step divides the momentum by ``1 − β1^t``
                            as Adam does. Uncorrected, the first steps are up to 10x smaller and a
                            run starts about ``1/(1 − β1)`` steps behind, and a short run's early
                            freeze leaves its first local steps short: a few dozen steps' loss.
``clip_synced_momentum``    ``False`` (0/1 Adam): with ``update_clip`` the momentum its syncs
                            restore is not clipped a second time.
``precondition_exchange``   ``True`` (1-bit Adam, 0/1 Adam): after the freeze the exchange carries
                            the momentum (0/1 Adam: the accumulated update) in the units of the
                            step, divided by ``sqrt(v̂)+eps``, and multiplies the average back. One
                            1-bit scale per block then moves each of its coordinates by about the
                            same amount, where the paper's momentum units move a coordinate by
                            ``scale/(sqrt(v̂)+eps)``, largest where ``v̂`` is small, which cost
                            short fine-tuning runs their accuracy (``docs/results.md``).
``var_update_scaler``       ``None`` (0/1 Adam): every step of the variance phase is a variance
                            step (8 bits), none a 1-bit gradient step. The paper's 16 puts 1-bit
                            gradient steps from step 17 on, a 1-bit gradient in the momentum
                            while the variance is still being estimated, which pre-training from
                            scratch does not survive (``docs/results.md``, "Pre-training from
                            scratch").
==========================  =====================================================================
"""

from __future__ import annotations

import logging

logger = logging.getLogger("hf_onebit")

#: the values of ``defaults=``
PRESETS = ("library", "paper")


class _LibraryDefault:
    """The default of a constructor argument whose value depends on ``defaults=`` (a sentinel)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<library default>"


#: what a constructor argument of the tables below defaults to (resolved by :func:`resolve`)
LIBRARY_DEFAULT = _LibraryDefault()

_ADAM_LIKE = dict(scale_per_tensor=True, scale_block=256, update_clip=1.0, warmup_bits=8)
_PAPER_ADAM_LIKE = dict(scale_per_tensor=False, scale_block=None, update_clip=None, warmup_bits=None)

#: the library's defaults, by optimizer class
LIBRARY: dict[str, dict] = {
    "OneBitAdam": dict(freeze_step="auto", precondition_exchange=True, **_ADAM_LIKE),
    "OneBitLamb": dict(_ADAM_LIKE, freeze_step="auto", bias_correction=True, update_clip=1.5, step_bound=3.0),
    "ZeroOneAdam": dict(var_freeze_step="auto", clip_synced_momentum=False, var_update_scaler=None,
                        momentum_correction=True, precondition_exchange=True, **_ADAM_LIKE),
    "BinSGDM": dict(stratified_votes=True),
}

#: the papers' values of the same arguments
PAPER: dict[str, dict] = {
    "OneBitAdam": dict(freeze_step=100000, precondition_exchange=False, **_PAPER_ADAM_LIKE),
    "OneBitLamb": dict(freeze_step=100000, bias_correction=False, step_bound=None, **_PAPER_ADAM_LIKE),
    "ZeroOneAdam": dict(var_freeze_step=100000, clip_synced_momentum=True, var_update_scaler=16,
                        momentum_correction=False, precondition_exchange=False, **_PAPER_ADAM_LIKE),
    "BinSGDM": dict(stratified_votes=False),
}


def check_preset(defaults) -> str:
    if defaults not in PRESETS:
        raise ValueError(f"defaults must be one of {PRESETS} (the measured defaults, or the papers'), got {defaults!r}")
    return defaults


def resolve(optimizer: str, defaults: str, **given) -> dict:
    """The values of ``given`` (constructor arguments of ``optimizer``, :data:`LIBRARY_DEFAULT`
    where the caller left one out), each left-out one taken from the ``defaults`` preset."""
    table = (LIBRARY if check_preset(defaults) == "library" else PAPER)[optimizer]
    return {k: table[k] if v is LIBRARY_DEFAULT else v for k, v in given.items()}


def library_arguments(optimizer: str) -> dict:
    """:data:`LIBRARY`'s arguments of the optimizer class named ``optimizer``."""
    return dict(LIBRARY.get(optimizer, {}))
