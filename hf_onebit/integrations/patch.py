"""The one place hf_onebit patches transformers: for unmodified scripts, via ``hf_onebit.run``.

A stock script (``HfArgumentParser(TrainingArguments)`` + ``Trainer``, e.g. transformers'
``run_glue.py``) cannot be told about hf_onebit, so the launcher (``python -m hf_onebit.run
script.py ...`` / ``hf-onebit run script.py ...``) calls :func:`install` before running it.
:func:`install` changes exactly five things, each needed and nothing else:

1. **``OptimizerNames`` gets four members** (``onebit_adam``, ``zeroone_adam``, ``onebit_lamb``,
   ``binsgdm``). ``HfArgumentParser`` builds the ``--optim`` choices from this enum and
   ``TrainingArguments.__post_init__`` converts the value with it; both reject unknown names,
   and there is no public way to add one. Python enums cannot be extended, so
   :func:`_add_enum_member` edits the enum's member tables (Python internals; checked on
   CPython 3.11). Wrong names are still rejected, now with a list that includes ours.
2. **``Trainer.get_optimizer_cls_and_kwargs``** (a public static method) is wrapped: for the
   four names it returns the hf_onebit class and its keyword arguments
   (:func:`hf_onebit.integrations.options.optimizer_kwargs`); otherwise it defers to the
   original. Hyperparameters come from ``--optim_args "freeze_step=400,..."``.
3. **``Trainer.train``** is wrapped: when the trainer uses an hf_onebit optimizer it runs
   :func:`hf_onebit.integrations.trainer.before_train` (start-up refusals, loss-scaling fix,
   :class:`~hf_onebit.integrations.callbacks.OneBitCallback` which attaches the hook, saves and
   restores per-rank state and logs), then the original ``train``. For every optimizer it
   first applies :func:`~hf_onebit.integrations.trainer_quirks.fix_loss_kwargs`, so that losses logged
   with ``--optim adamw_torch`` and with an hf_onebit optimizer compare.
4. **``TrainingArguments.__post_init__``** is wrapped: for the four names it runs
   :func:`on_parse` (the defaults of :mod:`hf_onebit.integrations.defaults` unless given, and the
   optimizer built over a dummy parameter), so mistakes stop the script while it parses.
5. The ``help`` of the ``optim`` and ``optim_args`` fields names our optimizers and their keys.

Checked with transformers 5.23 (and accelerate 1.15). If an internal that this relies on is
missing, :func:`install` raises :class:`PatchError` naming it; use
:class:`hf_onebit.OneBitTrainer` (which needs no patching) instead.
"""

import enum
import functools
import logging

logger = logging.getLogger("hf_onebit")

CHECKED_WITH = "transformers 5.23"
_state: dict = {}


class PatchError(RuntimeError):
    """transformers does not look like the version this patch was written for."""


def _add_enum_member(enum_cls: type, name: str, value: str) -> None:
    """Add a member to a ``(str, Enum)`` class. Uses CPython's Enum internals (3.10-3.13 layout:
    ``_member_names_``, ``_member_map_``, ``_value2member_map_``); kept to this one function."""
    if value in enum_cls._value2member_map_:
        return
    for attr in ("_member_names_", "_member_map_", "_value2member_map_"):
        if not hasattr(enum_cls, attr):
            raise PatchError(
                f"hf_onebit: cannot add --optim {value}: {enum_cls.__name__} has no {attr} (this Python's Enum"
                f" differs from the CPython 3.10-3.13 layout the patch was checked with). Use"
                " hf_onebit.OneBitTrainer / OneBitTrainingArguments instead of the launcher."
            )
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    type.__setattr__(enum_cls, name, member)


def _remove_enum_member(enum_cls: type, name: str, value: str) -> None:
    if enum_cls._member_map_.get(name) is not None and name in enum_cls._member_names_:
        enum_cls._member_names_.remove(name)
        del enum_cls._member_map_[name]
        enum_cls._value2member_map_.pop(value, None)
        try:
            type.__delattr__(enum_cls, name)
        except AttributeError:
            pass


def _internals():
    """The transformers objects the patch touches; a clear error if one is missing."""
    try:
        from transformers import Trainer, TrainingArguments
        from transformers.training_args import OptimizerNames
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise PatchError(
            f"hf_onebit: cannot import transformers' Trainer ({exc}). The launcher, OneBitTrainer and"
            " OneBitAccelerator need the hf extra: pip install 'hf-onebit[hf]' (transformers and accelerate)"
        ) from exc
    if not (isinstance(OptimizerNames, enum.EnumMeta) and issubclass(OptimizerNames, str)):
        raise PatchError(f"hf_onebit: transformers' OptimizerNames is not a str Enum (patch checked with {CHECKED_WITH})")
    raw = Trainer.__dict__.get("get_optimizer_cls_and_kwargs")
    if not isinstance(raw, staticmethod):
        raise PatchError(
            "hf_onebit: transformers.Trainer.get_optimizer_cls_and_kwargs is missing or no longer a static method"
            f" (patch checked with {CHECKED_WITH}); use hf_onebit.OneBitTrainer instead of the launcher"
        )
    if not callable(Trainer.__dict__.get("train")):
        raise PatchError(f"hf_onebit: transformers.Trainer.train is missing (patch checked with {CHECKED_WITH})")
    if not callable(TrainingArguments.__dict__.get("__post_init__")):
        raise PatchError(
            f"hf_onebit: transformers.TrainingArguments.__post_init__ is missing (patch checked with {CHECKED_WITH})"
        )
    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    for name in ("optim", "optim_args"):
        if name not in fields:
            raise PatchError(f"hf_onebit: transformers.TrainingArguments has no {name!r} field (checked with {CHECKED_WITH})")
    return Trainer, TrainingArguments, OptimizerNames, raw


def _set_help(field, text: str) -> None:
    """Replace a dataclass field's ``help`` (what ``HfArgumentParser`` shows in ``--help``)."""
    import types

    field.metadata = types.MappingProxyType({**field.metadata, "help": text})


def on_parse(args) -> None:
    """Run when a stock ``TrainingArguments`` with an hf_onebit ``--optim`` is built (parsed).

    Refuses FSDP/DeepSpeed, applies the training-loop settings the optimizer needs unless the user
    gave them (:func:`hf_onebit.integrations.defaults.apply_training_defaults`, as
    ``OneBitTrainingArguments`` does), and builds the optimizer over a dummy parameter so that a
    bad ``--optim_args`` fails now, before the model and data load. Prints what it changed or
    translated (rank 0, once).
    """
    from hf_onebit.integrations.defaults import apply_training_defaults
    from hf_onebit.integrations.logs import announce
    from hf_onebit.integrations.options import optim_name, validate
    from hf_onebit.integrations.checks import refuse_arguments

    name = optim_name(args.optim)
    refuse_arguments(args)
    changes = apply_training_defaults(name, args)
    notes = validate(name, args)
    for message in [*changes, *notes]:
        announce(message)


def install() -> None:
    """Teach stock ``TrainingArguments`` / ``Trainer`` the hf_onebit optimizers (idempotent)."""
    if _state:
        return
    Trainer, TrainingArguments, OptimizerNames, raw_get = _internals()
    from hf_onebit.integrations.options import (
        ONEBIT_OPTIMIZERS,
        optim_args_help,
        is_onebit_name,
        optimizer_kwargs,
    )
    from hf_onebit.integrations.trainer import before_train
    from hf_onebit.integrations.trainer_quirks import fix_loss_kwargs

    added = []
    for value in ONEBIT_OPTIMIZERS:  # 1. the --optim names
        if value not in OptimizerNames._value2member_map_:
            _add_enum_member(OptimizerNames, value.upper(), value)
            added.append(value)

    original_get = raw_get.__func__  # 2. building the optimizer

    def get_optimizer_cls_and_kwargs(args, model=None):
        if is_onebit_name(getattr(args, "optim", None)):
            return optimizer_kwargs(args.optim, args)
        return original_get(args, model)

    functools.update_wrapper(get_optimizer_cls_and_kwargs, original_get)
    Trainer.get_optimizer_cls_and_kwargs = staticmethod(get_optimizer_cls_and_kwargs)

    original_train = Trainer.__dict__["train"]  # 3. attach / checkpoints / logs

    @functools.wraps(original_train)
    def train(self, *args, **kwargs):
        # Every optimizer, not only hf_onebit's, so that logged losses compare across --optim values
        fix_loss_kwargs(self)
        before_train(self, args, kwargs)
        return original_train(self, *args, **kwargs)

    Trainer.train = train

    original_post_init = TrainingArguments.__dict__["__post_init__"]  # 4. checks when the arguments are parsed

    @functools.wraps(original_post_init)
    def __post_init__(self, *args, **kwargs):
        original_post_init(self, *args, **kwargs)
        if is_onebit_name(getattr(self, "optim", None)):
            on_parse(self)

    TrainingArguments.__post_init__ = __post_init__

    fields = TrainingArguments.__dataclass_fields__  # 5. --help names our optimizers and their --optim_args
    helps = {name: fields[name].metadata for name in ("optim", "optim_args")}
    _set_help(fields["optim"], f"{fields['optim'].metadata.get('help', 'The optimizer to use.')} hf_onebit (through"
              f" hf_onebit.run): {', '.join(ONEBIT_OPTIMIZERS)}.")
    _set_help(fields["optim_args"], f"{fields['optim_args'].metadata.get('help', '')} {optim_args_help()}".strip())
    _state.update(trainer=Trainer, enum=OptimizerNames, added=added, get=raw_get, train=original_train,
                  arguments=TrainingArguments, post_init=original_post_init, helps=helps)
    logger.debug("hf_onebit: transformers patched for --optim %s", ", ".join(ONEBIT_OPTIMIZERS))


def uninstall() -> None:
    """Undo :func:`install` (for tests)."""
    if not _state:
        return
    Trainer, OptimizerNames = _state["trainer"], _state["enum"]
    Trainer.get_optimizer_cls_and_kwargs = _state["get"]
    Trainer.train = _state["train"]
    _state["arguments"].__post_init__ = _state["post_init"]
    for name, metadata in _state["helps"].items():
        _state["arguments"].__dataclass_fields__[name].metadata = metadata
    for value in _state["added"]:
        _remove_enum_member(OptimizerNames, value.upper(), value)
    _state.clear()


def installed() -> bool:
    return bool(_state)
