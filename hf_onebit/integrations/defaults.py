"""The training-loop settings each hf_onebit optimizer needs that differ from the Trainer's defaults.

The optimizers' own arguments (the automatic freeze, one scale per block of each tensor, the update clip, the
warmup's bit width) are not here: their constructors apply them, from the one table of
:mod:`hf_onebit.optim.defaults` (``LIBRARY``; ``defaults="paper"`` for the papers' values), so
``OneBitAdam(params)``, ``--optim onebit_adam`` through :class:`~hf_onebit.OneBitTrainer` or the
launcher, the Accelerate plugin and the recipes build the same optimizer. This module holds what
only a training loop decides, and is the one place for it:

==================  =====================================================================
table               what it says
==================  =====================================================================
``NO_CLIPPING``     optimizers trained without gradient clipping unless ``--max_grad_norm``
                    is given, and why
``LEARNING_RATE``   optimizers whose learning rate differs from the Trainer's 5e-5 unless
                    ``--learning_rate`` is given, and why
``WARMUP_ALIASES``  ``--optim_args`` keys accepted under a common name (``freeze_step`` for 0/1
                    Adam means ``var_freeze_step``)
==================  =====================================================================

Both HF entry points apply the first two with :func:`apply_training_defaults` when the
``TrainingArguments`` are built: :class:`~hf_onebit.OneBitTrainingArguments` in its
``__post_init__`` (so :class:`~hf_onebit.OneBitTrainer` and ``recipes/glue/run_glue.py``), and the
launcher (``python -m hf_onebit.run``) on a stock ``TrainingArguments``
(:func:`hf_onebit.integrations.patch.on_parse`). Each change is printed once (rank 0) with the
flag that overrides it.

A value the user *gave* is never changed (:func:`explicit_at_construction`):

* arguments parsed from the command line by ``HfArgumentParser.parse_args_into_dataclasses``
  (which passes every field): an option on ``sys.argv`` (``--max_grad_norm 1``,
  ``--max-grad-norm=1``, an unambiguous prefix as argparse accepts it) or a key of a JSON/YAML
  file named on it. A script's own parser default (``parser.set_defaults(learning_rate=...)``)
  is not given: the table overrides it. A script that parses an ``args=`` list of its own names
  it with :func:`command_line`;
* ``OneBitTrainingArguments`` built in Python, or by ``HfArgumentParser.parse_dict`` /
  ``parse_json_file`` / ``parse_yaml_file``: a keyword passed to the constructor, whatever its
  value (``learning_rate=5e-5`` is kept for ``onebit_lamb``); one left out is not given;
* a stock ``TrainingArguments`` built in Python under the launcher (hf_onebit does not see its
  constructor's keywords): the command line rule above, on ``sys.argv``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

#: optimizers trained without gradient clipping unless --max_grad_norm is given, and why
NO_CLIPPING = {
    # BinSGDM's .grad is the vote average, each coordinate a mean of ±1 votes (of order 1), so its norm grows
    # like sqrt(#parameters): clipping at 1 divides every step by about that, and training stalls.
    "binsgdm": "its vote average has a norm of ~sqrt(#parameters): clipping at 1 shrinks every step by that factor",
    # After the freeze .grad holds the averaged momentum, so clipping bounds the momentum built from
    # unclipped gradients, while the frozen variance came from clipped ones: the step grows by up to
    # the clipping factor (docs/algorithms.md, "Gradient clipping with a frozen variance").
    "onebit_adam": "after the freeze .grad holds the averaged momentum: clipping would bound the momentum, not the"
                   " gradient",
    # After var_freeze_step the variance that divides the step is frozen, so clipping at 1 scales every step
    # by 1/||g|| (each rank's own gradient, in the local phase), which Adam's variance, built from the same
    # clipped gradients, would have absorbed: an lr schedule set by the gradient norm (docs/algorithms.md,
    # "Gradient clipping with a frozen variance").
    "zeroone_adam": "after the variance freezes, clipping scales each step by 1/||g|| and the frozen variance does not"
                    " undo it",
}

#: optimizers whose learning rate must differ from the Trainer's default (5e-5), the value, and why
LEARNING_RATE = {
    # LAMB's trust ratio moves each tensor by ~lr of its own norm per step, so each coordinate by ~lr times
    # a typical weight's magnitude (well below 1), where Adam moves it by ~lr: at Adam's 5e-5 a fine-tuning
    # run barely moves. At the frozen trust ratio 1-bit LAMB steps as LAMB at this lr: 1e-3 overshoots a
    # fine-tuning run of a few hundred steps, 3e-4 leaves a run of 60 at chance (docs/results.md, the stock script).
    "onebit_lamb": (5e-4, "LAMB's trust ratio moves each tensor by ~lr x its norm per step; at 5e-5 it barely"
                          " trains"),
    # BinSGDM moves each coordinate by lr x the mean of stochastic signs whose expectation m/(b+eps) is
    # well below 1 where gradients are noisy, so at Adam's lr it trains more slowly than Adam
    # (docs/results.md, "Accuracy against AdamW": BinSGDM at 5e-5 and at 1e-4).
    "binsgdm": (1e-4, "its step is lr x a mean of random signs whose expectation |m|/(b+eps) is well below 1"
                      " for noisy gradients; at Adam's 5e-5 it trains more slowly than Adam"),
}

#: --optim_args keys accepted under a common name: {optim: {common name: the optimizer's own name}}
WARMUP_ALIASES = {"zeroone_adam": {"freeze_step": "var_freeze_step"}}


# --------------------------------------------------------------------------- what the user gave
def _names_in_argv(argv: list[str]) -> set[str]:
    names = set()
    for token in map(str, argv):
        if token.startswith("--") and len(token) > 2:
            names.add(token[2:].split("=", 1)[0].replace("-", "_"))
    return names


def _keys_in_config_files(argv: list[str]) -> set[str]:
    """Keys of a JSON/YAML file given as an argument (stock scripts: ``script.py args.json``)."""
    keys: set[str] = set()
    for token in map(str, argv):
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


#: the command line being parsed, where a script parses a list of its own (see :func:`command_line`)
_COMMAND_LINE: list[str] | None = None


@contextlib.contextmanager
def command_line(argv: list[str]):
    """Within it, the command line is ``argv``, not ``sys.argv[1:]``: for a script that parses a list
    of its own (``parser.parse_args_into_dataclasses(args=argv)``), so that what it gives counts."""
    global _COMMAND_LINE
    previous, _COMMAND_LINE = _COMMAND_LINE, list(argv)
    try:
        yield
    finally:
        _COMMAND_LINE = previous


def explicit_options(argv: list[str] | None = None) -> set[str]:
    """The option names (``learning_rate``, ...) the user gave, from ``argv`` (default: the command
    line, ``sys.argv[1:]`` or the one :func:`command_line` names)."""
    if argv is None:
        argv = sys.argv[1:] if _COMMAND_LINE is None else _COMMAND_LINE
    argv = list(argv)
    return _names_in_argv(argv) | _keys_in_config_files(argv)


def given(option: str, explicit: set[str]) -> bool:
    """Whether ``option`` is in ``explicit``, also as a prefix argparse would expand (``--learning_r``)."""
    return any(name == option or (len(name) >= 3 and option.startswith(name)) for name in explicit)


def explicit_at_construction(passed: set[str] | None = None, fields: set[str] | None = None) -> set[str]:
    """The option names the user gave to the ``TrainingArguments`` being built.

    ``passed``: the keywords its constructor received, where known (``OneBitTrainingArguments``
    records them); ``fields``: every field its constructor takes. Keywords for a subset of the
    fields were written by a person (Python, ``parse_dict``, a JSON/YAML file): they are what was
    given. Keywords for every field come from ``HfArgumentParser.parse_args_into_dataclasses``
    (or ``dataclasses.replace``), which passes defaults too: then the command line decides.
    """
    if passed is not None and fields is not None and not fields <= set(passed):
        return set(passed)
    return explicit_options()


# --------------------------------------------------------------------------- applying them
def training_defaults(optim: str, args, explicit: set[str]) -> list[tuple[str, object, str]]:
    """The changes :func:`apply_training_defaults` would make: ``(attribute, value, message)``."""
    changes = []
    if optim in NO_CLIPPING and not given("max_grad_norm", explicit) and args.max_grad_norm:
        changes.append(("max_grad_norm", 0.0,
                        f"--max_grad_norm 0 for --optim {optim} (was {args.max_grad_norm}): {NO_CLIPPING[optim]}."
                        " Pass --max_grad_norm to choose."))
    if optim in LEARNING_RATE and not given("learning_rate", explicit):
        lr, why = LEARNING_RATE[optim]
        if args.learning_rate != lr:
            field = getattr(type(args), "__dataclass_fields__", {}).get("learning_rate")
            whose = "the Trainer's default" if field is not None and args.learning_rate == field.default else \
                "the script's default"
            changes.append(("learning_rate", lr,
                            f"--learning_rate {lr:g} for --optim {optim} (was {args.learning_rate:g}, {whose}):"
                            f" {why}. Pass --learning_rate to choose."))
    return changes


def apply_training_defaults(optim: str, args, explicit: set[str] | None = None) -> list[str]:
    """Give ``args`` (a ``TrainingArguments``) the settings ``optim`` needs, unless the user gave them.

    ``explicit``: the option names the user gave (default: :func:`explicit_at_construction`).
    Returns the messages (one per change, naming the flag that overrides it) for the caller to
    print with :func:`hf_onebit.integrations.logs.announce`.
    """
    explicit = explicit_at_construction() if explicit is None else explicit
    messages = []
    for attribute, value, message in training_defaults(optim, args, explicit):
        setattr(args, attribute, value)
        messages.append(message)
    return messages
