"""The settings each hf_onebit optimizer needs that differ from the Trainer's defaults, in one table.

Shared by the launcher (``python -m hf_onebit.run``, applied to the stock ``TrainingArguments``
when they are parsed, see :func:`apply_launcher_defaults`) and by ``recipes/glue/run_glue.py``
(its own ``apply_onebit_defaults``), so the two cannot drift:

=================  =====================================================================
table              what it says
=================  =====================================================================
``FREEZE_ARGUMENT`` the constructor argument that ends each optimizer's uncompressed warmup
``NO_CLIPPING``    optimizers trained without gradient clipping unless ``--max_grad_norm``
                   is given, and why
``LEARNING_RATE``  optimizers whose learning rate differs from the Trainer's 5e-5 unless
                   ``--learning_rate`` is given, and why
``WARMUP_ALIASES`` ``--optim_args`` keys accepted under a common name (``freeze_step`` for 0/1
                   Adam means ``var_freeze_step``)
=================  =====================================================================

:func:`default_freeze_arguments` decides the warmup's end (automatic) and the compression scales
(per tensor) used when the user gives none.

A value counts as *given* when its flag is on the command line (``--max_grad_norm 1``,
``--max-grad-norm=1``, an unambiguous prefix as argparse accepts it) or a key of the JSON/YAML
file a stock script reads its arguments from; then it is never changed. Every change is printed
once (rank 0) with the flag that overrides it.
"""

from __future__ import annotations

import json
import os
import sys

#: the argument that ends each optimizer's uncompressed warmup (0/1 Adam: its variance phase)
FREEZE_ARGUMENT = {"onebit_adam": "freeze_step", "onebit_lamb": "freeze_step", "zeroone_adam": "var_freeze_step"}

#: optimizers trained without gradient clipping unless --max_grad_norm is given, and why
NO_CLIPPING = {
    # BinSGDM's .grad is the vote average, whose norm is ~sqrt(#parameters): clipping shrinks every step.
    # Measured with transformers' run_mlm.py (MiniLM, 2 processes): loss 10.78 -> 10.87 with clipping at 1,
    # 10.78 -> 7.85 without.
    "binsgdm": "its vote average has a norm of ~sqrt(#parameters): clipping at 1 shrinks every step by that factor",
    # After the freeze .grad holds the averaged momentum, so clipping bounds the momentum built from
    # unclipped gradients, while the frozen variance came from clipped ones: the step grows by up to
    # the clipping factor. Measured with the GLUE recipe: 2 seeds, 82.2 / 81.2 with clipping at 1,
    # 81.7 / 83.0 without (AdamW with clipping 82.8 / 82.4; docs/results.md).
    "onebit_adam": "after the freeze .grad holds the averaged momentum: clipping would bound the momentum, not the"
                   " gradient",
    # After var_freeze_step the variance that divides the step is frozen, so clipping at 1 scales every step
    # by 1/||g|| (each rank's own gradient: ||g|| 2.3-5.3 on the tweets after the freeze), which Adam's variance
    # would have absorbed. The stock table, paired with AdamW: tweets -1.15 / -0.63 points (automatic / 20%
    # freeze, 3 seeds) with clipping, +0.21 / +0.58 without; Rotten Tomatoes (3 seeds) -0.45 / +0.13 -> +0.03 / +0.03.
    "zeroone_adam": "after the variance freezes, clipping scales each step by 1/||g|| and the frozen variance does not"
                    " undo it",
}

#: optimizers whose learning rate must differ from the Trainer's default (5e-5), the value, and why
LEARNING_RATE = {
    # LAMB's trust ratio moves each tensor by ~lr of its own norm per step: at 5e-5 a fine-tuning run
    # barely moves (transformers' run_classification.py, MiniLM: accuracy 0.86 against AdamW's 0.97).
    # The GLUE recipe's value (recipes/glue/run_table.py).
    "onebit_lamb": (1e-3, "LAMB's trust ratio moves each tensor by ~lr x its norm per step; at 5e-5 it barely"
                          " trains"),
    # BinSGDM moves each coordinate by lr x the mean of stochastic signs whose expectation m/(b+eps) is
    # well below 1 where gradients are noisy, so at Adam's lr it trains more slowly than Adam. The stock
    # table (docs/results.md), 3 seeds each, paired with AdamW at 5e-5: tweets -1.17 points at 5e-5, +1.46
    # at 1e-4; Rotten Tomatoes -0.24 at 5e-5, +1.70 at 1e-4. The GLUE recipe: 78.9% at 3e-5, 83.1% at 1e-4.
    "binsgdm": (1e-4, "its step is lr x a mean of random signs whose expectation |m|/(b+eps) is well below 1"
                      " for noisy gradients; at Adam's 5e-5 it trains more slowly than Adam"),
}

#: --optim_args keys accepted under a common name: {optim: {common name: the optimizer's own name}}
WARMUP_ALIASES = {"zeroone_adam": {"freeze_step": "var_freeze_step"}}


def default_freeze_arguments(optim: str) -> dict:
    """The constructor arguments the HF integration passes unless the user gives them.

    * the warmup's end: ``"auto"`` (:class:`~hf_onebit.optim.freeze.AutoFreeze`; the callback fits
      its bounds to the run's length when training starts, see
      :func:`hf_onebit.optim.freeze.AutoFreeze.for_run`): nobody can be expected to find the
      freeze step by trial and error, and a fixed default (the optimizers' ``100000``) is either
      longer than a fine-tuning run or too early for it;
    * ``scale_per_tensor=True`` for the optimizers that compress with error feedback: one scale
      per parameter tensor, so small-gradient tensors are not rebuilt at their bucket's scale;
    * ``update_clip=1.0`` for 1-bit Adam, 0/1 Adam and 1-bit LAMB: where the variance is stale
      (after the freeze; 0/1 Adam's steps that do not update it) no coordinate's adaptive step
      exceeds 1 (``lr`` for the Adams), which Adam's own update nearly never exceeds; it keeps an
      early freeze and 1-bit noise on small-variance coordinates from blowing up the step
      (docs/algorithms.md, "Update clip");
    * ``clip_synced_momentum=False`` for 0/1 Adam: with the clip, the momentum its syncs restore
      is not clipped as well (on the stock table: −0.45 / +0.13 points against AdamW with the
      automatic / 20% freeze, against −0.82 / −1.41 with it clipped; docs/results.md).
    """
    if optim not in FREEZE_ARGUMENT:
        return {}
    args = {FREEZE_ARGUMENT[optim]: "auto", "scale_per_tensor": True, "update_clip": 1.0}
    if optim == "zeroone_adam":
        args["clip_synced_momentum"] = False
    return args


# --------------------------------------------------------------------------- what the user gave
def _names_in_argv(argv: list[str]) -> set[str]:
    names = set()
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            names.add(token[2:].split("=", 1)[0].replace("-", "_"))
    return names


def _keys_in_config_files(argv: list[str]) -> set[str]:
    """Keys of a JSON/YAML file given as an argument (stock scripts: ``script.py args.json``)."""
    keys: set[str] = set()
    for token in argv:
        if not token.endswith((".json", ".yaml", ".yml")) or not os.path.isfile(token):
            continue
        try:
            with open(token, encoding="utf-8") as f:
                if token.endswith(".json"):
                    data = json.load(f)
                else:
                    import yaml

                    data = yaml.safe_load(f)
        except Exception:  # not an arguments file; the script will say so if it reads it
            continue
        if isinstance(data, dict):
            keys.update(str(k) for k in data)
    return keys


def explicit_options(argv: list[str] | None = None) -> set[str]:
    """The option names (``learning_rate``, ...) the user gave, from ``argv`` (default ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return _names_in_argv(argv) | _keys_in_config_files(argv)


def given(option: str, explicit: set[str]) -> bool:
    """Whether ``option`` is in ``explicit``, also as a prefix argparse would expand (``--learning_r``)."""
    return any(name == option or (len(name) >= 3 and option.startswith(name)) for name in explicit)


# --------------------------------------------------------------------------- applying them
def launcher_defaults(optim: str, args, explicit: set[str]) -> list[tuple[str, object, str]]:
    """The changes :func:`apply_launcher_defaults` would make: ``(attribute, value, message)``."""
    changes = []
    if optim in NO_CLIPPING and not given("max_grad_norm", explicit) and args.max_grad_norm:
        changes.append(("max_grad_norm", 0.0,
                        f"--max_grad_norm 0 for --optim {optim} (was {args.max_grad_norm}): {NO_CLIPPING[optim]}."
                        " Pass --max_grad_norm to choose."))
    if optim in LEARNING_RATE and not given("learning_rate", explicit):
        lr, why = LEARNING_RATE[optim]
        if args.learning_rate != lr:
            changes.append(("learning_rate", lr,
                            f"--learning_rate {lr:g} for --optim {optim} (was {args.learning_rate:g}, the Trainer's"
                            f" default): {why}. Pass --learning_rate to choose."))
    return changes


def apply_launcher_defaults(optim: str, args, explicit: set[str] | None = None) -> list[str]:
    """Give ``args`` (a ``TrainingArguments``) the settings ``optim`` needs, unless the user gave them.

    Returns the messages (one per change, naming the flag that overrides it).
    """
    explicit = explicit_options() if explicit is None else explicit
    messages = []
    for attribute, value, message in launcher_defaults(optim, args, explicit):
        setattr(args, attribute, value)
        messages.append(message)
    return messages
