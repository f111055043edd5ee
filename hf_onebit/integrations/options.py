"""The ``--optim`` names and how a Trainer's arguments become an optimizer's keyword arguments.

No ``transformers`` import here: this module only reads attributes of a ``TrainingArguments``
(or anything that has them), so the launcher, the Trainer subclass and the tests share it.

Where each hyperparameter comes from
------------------------------------
==================  ===================================================================
``lr``              ``--learning_rate`` (the LR scheduler then changes it every step)
``betas``           ``(--adam_beta1, --adam_beta2)``; BinSGDM's single ``beta`` is ``--adam_beta1``
``eps``             ``--adam_epsilon``
``weight_decay``    ``--weight_decay`` (the Trainer puts biases and norms in a group with 0)
BinSGDM ``seed``    ``--seed`` unless ``seed=`` is given in ``--optim_args``
the rest            the optimizer's own flags of :class:`~hf_onebit.OneBitTrainingArguments`
                    (``--freeze_step`` ...) or ``--optim_args "key=value,..."``; what is not
                    given is left to the constructor's defaults (:mod:`hf_onebit.optim.defaults`:
                    ``--optim_args defaults=paper`` for the papers' values)
==================  ===================================================================

Values in ``--optim_args`` are converted to the constructor's annotated type (``int``,
``float``, ``bool``, ``bool | None``); an unknown key, a key the Trainer already sets, a value
of the wrong type or a key given both as a flag and in ``--optim_args`` is an error that
lists what is accepted.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass

from hf_onebit.integrations.defaults import WARMUP_ALIASES
from hf_onebit.optim import (
    BinSGDM,
    OneBitAdam,
    OneBitLamb,
    OneBitOptimizer,
    ZeroOneAdam,
)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str  # the --optim value
    cls: type[OneBitOptimizer]
    flags: tuple[str, ...]  # hyperparameters with their own OneBitTrainingArguments flag


ONEBIT_OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec("onebit_adam", OneBitAdam, ("freeze_step",)),
        OptimizerSpec(
            "zeroone_adam", ZeroOneAdam,
            ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"),
        ),
        OptimizerSpec("onebit_lamb", OneBitLamb, ("freeze_step",)),
        OptimizerSpec("binsgdm", BinSGDM, ()),
    )
}

#: Every hyperparameter flag of :class:`~hf_onebit.OneBitTrainingArguments`.
ALL_FLAGS: tuple[str, ...] = tuple(dict.fromkeys(f for s in ONEBIT_OPTIMIZERS.values() for f in s.flags))

#: Constructor arguments the Trainer's own arguments provide, and the flag that sets each.
FROM_TRAINING_ARGS = {
    "lr": "--learning_rate",
    "betas": "--adam_beta1 / --adam_beta2",
    "beta": "--adam_beta1",
    "eps": "--adam_epsilon",
    "weight_decay": "--weight_decay",
}


def optim_args_help() -> str:
    """What ``--optim_args`` means for the hf_onebit optimizers (added to ``--help`` by the launcher)."""
    keys = []
    for spec in ONEBIT_OPTIMIZERS.values():
        names = sorted(_settable(spec))
        aliases = [f"{a} (= {own})" for a, own in WARMUP_ALIASES.get(spec.name, {}).items()]
        keys.append(f"{spec.name}: {', '.join(names + aliases)}")
    return (
        "hf_onebit optimizers: constructor arguments as key=value,key=value (e.g. \"freeze_step=400\"); "
        + "; ".join(keys)
        + ". lr, betas, eps and weight_decay come from --learning_rate, --adam_beta1/--adam_beta2, --adam_epsilon"
        " and --weight_decay. Checked when the arguments are parsed."
    )


def optim_name(value) -> str:
    """The plain string of an ``--optim`` value (a str or a str-valued enum member)."""
    return str(getattr(value, "value", value))


def is_onebit_name(value) -> bool:
    return optim_name(value) in ONEBIT_OPTIMIZERS


def _settable(spec: OptimizerSpec) -> dict[str, object]:
    """Constructor parameters that ``--optim_args`` may set, with their annotated types."""
    hints = typing.get_type_hints(spec.cls.__init__)
    params = inspect.signature(spec.cls.__init__).parameters
    return {
        name: hints.get(name, str)
        for name in params
        if name not in ("self", "params") and name not in FROM_TRAINING_ARGS
    }


_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


def _convert(spec: OptimizerSpec, key: str, text: str, kind) -> object:
    def fail(expected: str):
        return ValueError(
            f"--optim_args: {key}={text!r} is not {expected} ({spec.name} needs {key}: {_type_name(kind)})"
        )

    lowered = text.strip().lower()
    args = typing.get_args(kind)
    if type(None) in args:  # Optional[X]: "none" / "auto" mean None
        if lowered in ("none", "auto", "null"):
            return None
        args = tuple(a for a in args if a is not type(None))
        kind = args[0] if len(args) == 1 else kind
    if len(args) > 1 and typing.get_origin(kind) in (typing.Union, types.UnionType):  # int | str: first that fits
        for member in args:
            if member is str:
                continue
            try:
                return _convert(spec, key, text, member)
            except ValueError:
                pass
        if str in args:
            return text
        raise fail(f"one of {_type_name(kind)}")
    if kind is bool:
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise fail("a boolean (true/false)")
    if kind is int:
        try:
            return int(lowered)
        except ValueError:
            raise fail("an integer") from None
    if kind is float:
        try:
            return float(lowered)
        except ValueError:
            raise fail("a number") from None
    return text


def _type_name(kind) -> str:
    if typing.get_args(kind):
        return " | ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(kind)).replace("NoneType", "None")
    return getattr(kind, "__name__", str(kind))


def parse_optim_args(text: str | None) -> dict[str, str]:
    """``"a=1, b=x"`` -> ``{"a": "1", "b": "x"}`` with a clear error for a malformed entry."""
    out: dict[str, str] = {}
    if not text:
        return out
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"--optim_args: {item!r} is not of the form key=value (entries are separated by commas)")
        if key in out:
            raise ValueError(f"--optim_args: {key} is given twice")
        out[key] = value
    return out


def optimizer_kwargs(name, args, notes: list | None = None) -> tuple[type[OneBitOptimizer], dict]:
    """The class and constructor keyword arguments (without ``params``) for ``--optim name``.

    ``args`` is a ``TrainingArguments``; the hyperparameter flags of
    :class:`~hf_onebit.OneBitTrainingArguments` are read if present. A common warmup name in
    ``--optim_args`` (``freeze_step`` for ``zeroone_adam``: :data:`.defaults.WARMUP_ALIASES`) is
    translated, with a line appended to ``notes``. Arguments the user did not give are left out:
    the constructor applies its defaults (:data:`hf_onebit.optim.defaults.LIBRARY`, or the
    papers' with ``--optim_args defaults=paper``), the same as for ``OneBitAdam(params)``.
    """
    name = optim_name(name)
    spec = ONEBIT_OPTIMIZERS.get(name)
    if spec is None:
        raise ValueError(f"{name!r} is not an hf_onebit optimizer; choose one of {sorted(ONEBIT_OPTIMIZERS)}")
    kwargs: dict = {"lr": float(args.learning_rate), "eps": float(args.adam_epsilon),
                    "weight_decay": float(args.weight_decay)}
    if spec.cls is BinSGDM:
        kwargs["beta"] = float(args.adam_beta1)
    else:
        kwargs["betas"] = (float(args.adam_beta1), float(args.adam_beta2))

    settable = _settable(spec)
    for flag in ALL_FLAGS:
        value = getattr(args, flag, None)
        if value is None:
            continue
        if flag not in spec.flags:
            own = ", ".join(f"--{f}" for f in spec.flags) or "none; use --optim_args"
            raise ValueError(f"--{flag} does not apply to --optim {name} ({spec.cls.__name__}); its flags: {own}")
        kwargs[flag] = warmup_value(value) if flag in ("freeze_step", "var_freeze_step") else value

    aliases = WARMUP_ALIASES.get(name, {})
    for key, text in parse_optim_args(getattr(args, "optim_args", None)).items():
        if key in aliases and key not in settable:
            own = aliases[key]
            if notes is not None:
                notes.append(f"--optim_args {key}={text} means {own}={text} for --optim {name} ({spec.cls.__name__})")
            key = own
        if key in FROM_TRAINING_ARGS and key in inspect.signature(spec.cls.__init__).parameters:
            raise ValueError(
                f"--optim_args: {key} comes from the training arguments for --optim {name}: set it with"
                f" {FROM_TRAINING_ARGS[key]}"
            )
        if key not in settable:
            raise ValueError(
                f"--optim_args: unknown key {key!r} for --optim {name} ({spec.cls.__name__}); valid keys:"
                f" {', '.join(sorted(settable))} (lr, betas, eps and weight_decay come from --learning_rate,"
                " --adam_beta1/--adam_beta2, --adam_epsilon and --weight_decay)"
            )
        if key in kwargs:
            raise ValueError(f"--optim_args: {key} is also set by --{key}; give it once")
        kwargs[key] = _convert(spec, key, text, settable[key])

    if spec.cls is BinSGDM and "seed" not in kwargs:
        kwargs["seed"] = int(getattr(args, "seed", 0)) % 2**64
    return spec.cls, kwargs


def validate(name, args) -> list[str]:
    """Build the optimizer over a dummy parameter, so a bad value fails when the arguments are parsed.

    Returns the notes of :func:`optimizer_kwargs` (translated names) for the caller to print.
    """
    import torch

    notes: list[str] = []
    cls, kwargs = optimizer_kwargs(name, args, notes)
    cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    return notes


def warmup_value(value):
    """``--freeze_step`` / ``--var_freeze_step`` as given (text): an integer, or ``"auto"`` as is."""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return value  # "auto", or something the optimizer refuses with a clear message


def warmup_end(optimizer: OneBitOptimizer) -> int | None:
    """The last uncompressed warmup step of 1-bit Adam / LAMB (``None`` for the others, and while an
    automatic freeze has not chosen yet).

    0/1 Adam compresses from its first phase on and BinSGDM from step 1.
    """
    auto = getattr(optimizer, "auto_freeze", None)
    if auto is not None and auto.chosen is None:
        return None
    value = getattr(optimizer, "freeze_step", None)
    return None if value is None else int(value)
