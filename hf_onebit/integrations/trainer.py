"""hf_onebit in the Hugging Face Trainer: ``--optim onebit_adam`` and friends.

::

    from hf_onebit import OneBitTrainer, OneBitTrainingArguments

    args = OneBitTrainingArguments(output_dir="out", optim="onebit_adam", freeze_step=400,
                                   learning_rate=2e-5, per_device_train_batch_size=32)
    OneBitTrainer(model=model, args=args, train_dataset=train).train()

or from the command line with ``HfArgumentParser(OneBitTrainingArguments)``:
``--optim onebit_adam --freeze_step 400`` / ``--optim_args "freeze_step=400,auto_mask=false"``.

What it adds to ``transformers.Trainer`` (public API only; nothing is patched):

* :class:`OneBitTrainingArguments` accepts the four names next to every stock ``--optim``
  value, plus the optimizers' own flags (:mod:`.options` says where each hyperparameter
  comes from). Its ``optim`` field is a plain string so that ``HfArgumentParser`` takes the
  new names; ``__post_init__`` validates it and lists the valid names on a typo, and applies
  the training-loop settings the optimizer needs unless the user gave them (no clipping for
  BinSGDM, 1-bit Adam and 0/1 Adam, LAMB's and BinSGDM's learning rate:
  :mod:`.defaults`, the table and the rule for "given" the launcher uses too), printing each
  change once. The optimizer's own arguments left out take the constructors' defaults
  (:mod:`hf_onebit.optim.defaults`), as everywhere else.
* :meth:`OneBitTrainer.get_optimizer_cls_and_kwargs` (a public override point) builds the
  hf_onebit optimizer over the Trainer's usual parameter groups (no weight decay on biases
  and norms); stock LR schedulers drive its learning rate.
* :class:`~hf_onebit.integrations.callbacks.OneBitCallback` attaches the communication hook to
  the DDP model Accelerate created, saves and restores every rank's compression state with
  each checkpoint, and adds the compression figures to the logs.
* Refuses at start-up what hf_onebit cannot serve (:mod:`.checks`).
* Makes the training gradient the plain mean over the global batch for models whose
  ``forward`` takes ``**kwargs`` but whose loss ignores ``num_items_in_batch`` (see
  :func:`~hf_onebit.integrations.trainer_quirks.fix_loss_kwargs`).
"""

import dataclasses
import inspect
import logging
from dataclasses import dataclass, field

from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from transformers.training_args import OptimizerNames

from hf_onebit.integrations import checks
from hf_onebit.integrations.accelerate import unwrap_optimizer
from hf_onebit.integrations.callbacks import OneBitCallback
from hf_onebit.integrations.defaults import apply_training_defaults, explicit_at_construction
from hf_onebit.integrations.options import (
    ALL_FLAGS,
    ONEBIT_OPTIMIZERS,
    is_onebit_name,
    optim_args_help,
    optim_name,
    optimizer_kwargs,
    validate,
)
from hf_onebit.integrations.logs import announce
from hf_onebit.integrations.trainer_quirks import default_find_unused_off, fix_loss_kwargs
from hf_onebit.optim import OneBitOptimizer

logger = logging.getLogger("hf_onebit")

_STOCK_OPTIM_DEFAULT = TrainingArguments.__dataclass_fields__["optim"].default


def valid_optim_names() -> list[str]:
    """hf_onebit's names first, then transformers' ``OptimizerNames``."""
    return list(ONEBIT_OPTIMIZERS) + [m.value for m in OptimizerNames if m.value not in ONEBIT_OPTIMIZERS]


def unknown_optim_message(name: str) -> str:
    return (
        f"--optim {name!r} is not a known optimizer. hf_onebit: {', '.join(ONEBIT_OPTIMIZERS)}; transformers:"
        f" {', '.join(m.value for m in OptimizerNames if m.value not in ONEBIT_OPTIMIZERS)}"
    )


@dataclass
class OneBitTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the hf_onebit optimizers and their hyperparameter flags.

    ``learning_rate``, ``adam_beta1``/``adam_beta2`` (BinSGDM: ``beta = adam_beta1``),
    ``adam_epsilon`` and ``weight_decay`` are the stock arguments. Every other constructor
    argument can be given in ``optim_args`` (``"auto_mask=false,bias_correction=true"``).

    With an hf_onebit ``optim``, ``max_grad_norm`` and ``learning_rate`` follow
    :mod:`hf_onebit.integrations.defaults` (``NO_CLIPPING``, ``LEARNING_RATE``) unless given:
    on the command line (``sys.argv``) parsed by ``HfArgumentParser``, or as a keyword of this constructor in
    Python (any value, the field's default included: ``learning_rate=5e-5`` is kept). The
    keywords are recorded by ``__new__``, which receives the same arguments as the generated
    ``__init__`` (also in dataclass subclasses).
    """

    optim: str = field(
        default=_STOCK_OPTIM_DEFAULT,
        metadata={
            "help": "The optimizer: hf_onebit's onebit_adam, zeroone_adam, onebit_lamb, binsgdm, or any"
            " transformers OptimizerNames value (adamw_torch, ...)."
        },
    )
    optim_args: str | None = field(default=None, metadata={"help": optim_args_help()})
    # str, not int | str: HfArgumentParser accepts only Optional unions; options.warmup_value converts
    freeze_step: str | None = field(
        default=None,
        metadata={
            "help": "onebit_adam / onebit_lamb: last step of the uncompressed warmup, or 'auto' (the default here:"
            " freeze when the variance has settled, between 10 and 40 percent of the run)."
        },
    )
    var_freeze_step: str | None = field(
        default=None,
        metadata={"help": "zeroone_adam: last step of the variance phase, or 'auto' (the default here)."},
    )
    var_update_scaler: int | None = field(
        default=None,
        metadata={"help": "zeroone_adam: variance steps before their interval doubles (default: never, every"
                          " variance-phase step is a variance step; the paper's 16)."},
    )
    local_step_scaler: int | None = field(
        default=None,
        metadata={"help": "zeroone_adam: local-phase steps before the sync interval doubles (default 32678)."},
    )
    local_step_clipper: int | None = field(
        default=None, metadata={"help": "zeroone_adam: largest interval between syncs (default 16)."}
    )

    def __new__(cls, *args, **kwargs):
        # the keywords given to the constructor (the generated __init__ gets the same arguments)
        self = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        self._onebit_passed = frozenset(names[: len(args)]) | frozenset(kwargs)
        return self

    def __post_init__(self):
        name = optim_name(self.optim)
        fields = {f.name for f in dataclasses.fields(self) if f.init}
        self._onebit_explicit = frozenset(explicit_at_construction(getattr(self, "_onebit_passed", None), fields))
        if is_onebit_name(name):
            checks.refuse_arguments(self)
            if self.ddp_find_unused_parameters is None:
                self.ddp_find_unused_parameters = False  # see hf_onebit.integrations.checks.check_find_unused
            # The stock __post_init__ converts `optim` to transformers' OptimizerNames enum, which does
            # not know the hf_onebit names: let it convert a stock name, then put ours back.
            self.optim = _STOCK_OPTIM_DEFAULT
            try:
                super().__post_init__()
            finally:
                self.optim = name
            self._onebit_training_defaults(name, self._onebit_explicit)
            return
        try:
            OptimizerNames(name)
        except ValueError:
            raise ValueError(unknown_optim_message(name)) from None
        given = [f"--{f}" for f in ALL_FLAGS if getattr(self, f) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to hf_onebit optimizers, not to --optim {name}")
        super().__post_init__()

    def _onebit_training_defaults(self, name: str, explicit) -> None:
        for message in apply_training_defaults(name, self, set(explicit)):
            announce(message)
        for note in validate(name, self):  # fail now, not at the first step, on a bad hyperparameter
            announce(note)

    def set_optimizer(self, name="adamw_torch", learning_rate=None, weight_decay=0, beta1=0.9, beta2=0.999,
                      epsilon=1e-8, args=None):
        """As in ``TrainingArguments``, also for the hf_onebit names.

        ``learning_rate`` left out is the Trainer's 5e-5, or for an hf_onebit name the value
        :data:`~hf_onebit.integrations.defaults.LEARNING_RATE` gives it; ``max_grad_norm`` follows
        :data:`~hf_onebit.integrations.defaults.NO_CLIPPING` unless it was given when these
        arguments were built.
        """
        stock_lr = TrainingArguments.__dataclass_fields__["learning_rate"].default
        if not is_onebit_name(name):
            lr = stock_lr if learning_rate is None else learning_rate
            return super().set_optimizer(name, lr, weight_decay, beta1, beta2, epsilon, args)
        self.optim = optim_name(name)
        self.learning_rate = stock_lr if learning_rate is None else learning_rate
        self.weight_decay = weight_decay
        self.adam_beta1, self.adam_beta2, self.adam_epsilon = beta1, beta2, epsilon
        self.optim_args = args
        explicit = set(getattr(self, "_onebit_explicit", ()))
        if learning_rate is not None:
            explicit.add("learning_rate")
        self._onebit_training_defaults(self.optim, explicit)
        return self


# ---------------------------------------------------------------------------- shared with the launcher
def uses_onebit(trainer) -> bool:
    """Whether ``trainer`` trains with an hf_onebit optimizer (by name, instance or class)."""
    if is_onebit_name(getattr(trainer.args, "optim", None)):
        return True
    if isinstance(unwrap_optimizer(getattr(trainer, "optimizer", None)), OneBitOptimizer):
        return True
    cls_kwargs = getattr(trainer, "optimizer_cls_and_kwargs", None)
    return bool(cls_kwargs) and isinstance(cls_kwargs[0], type) and issubclass(cls_kwargs[0], OneBitOptimizer)


def enable(trainer) -> OneBitCallback | None:
    """Install hf_onebit on a Trainer that uses one of its optimizers (idempotent).

    Runs the start-up refusals, fixes the loss scaling (:func:`fix_loss_kwargs`), builds DDP
    without ``find_unused_parameters`` unless asked (:func:`default_find_unused_off`) and puts
    :class:`OneBitCallback` first in the callback list. Returns the callback, or ``None`` if the
    trainer does not use an hf_onebit optimizer.
    """
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, OneBitCallback) and cb.trainer is trainer:
            return cb
    if not uses_onebit(trainer):
        return None
    checks.check_trainer(trainer)
    fix_loss_kwargs(trainer)
    default_find_unused_off(trainer)
    cb = OneBitCallback(trainer)
    _add_callback_first(trainer, cb)
    return cb


def _add_callback_first(trainer, callback) -> None:
    """Put ``callback`` before every other one, so the reporters (progress bar, TensorBoard, W&B)
    run after it and log what it adds to ``logs``. ``Trainer.add_callback`` appends; the
    handler's ``callbacks`` list (transformers 5.23 ``CallbackHandler``) is where the order lives."""
    callbacks = getattr(trainer.callback_handler, "callbacks", None)
    if isinstance(callbacks, list):
        callbacks.insert(0, callback)
    else:  # pragma: no cover - another CallbackHandler layout: keys are still added, reporters may miss them
        logger.warning("hf_onebit: cannot put its callback first; reporters may not show the onebit/ log keys")
        trainer.add_callback(callback)


def resolve_resume(trainer, train_args: tuple, train_kwargs: dict) -> str | None:
    """The checkpoint directory ``Trainer.train(*train_args, **train_kwargs)`` resumes from."""
    bound = inspect.signature(Trainer.train).bind_partial(trainer, *train_args, **train_kwargs)
    resume = bound.arguments.get("resume_from_checkpoint")
    if resume is None or resume is False:
        return None
    if resume is True:
        return get_last_checkpoint(trainer.args.output_dir)  # what Trainer.train does with True
    return str(resume)


def note_precision(trainer) -> bool:
    """Say once that ``--fp16`` runs in fp32 where Accelerate has no fp16 autocast (CPU). Returns whether it did.

    Accelerate (checked: 1.15) accepts ``mixed_precision="fp16"`` on CPU but then uses neither
    autocast nor a ``GradScaler`` (``accelerator.native_amp`` is False): the run is fp32.
    """
    accelerator = getattr(trainer, "accelerator", None)
    if not getattr(trainer.args, "fp16", False) or accelerator is None:
        return False
    if getattr(accelerator, "native_amp", True) or getattr(accelerator, "scaler", None) is not None:
        return False
    device = getattr(getattr(accelerator, "device", None), "type", "?")
    return announce(
        f"--fp16 on {device}: Accelerate runs this in fp32 (no fp16 autocast or loss scaling on {device}). For mixed"
        " precision on CPU use --bf16 (with --use_cpu)."
    )


def before_train(trainer, train_args: tuple = (), train_kwargs: dict | None = None) -> None:
    """Called at the start of ``train()``: enable hf_onebit and remember the checkpoint to resume."""
    note_precision(trainer)
    cb = enable(trainer)
    if cb is not None:
        checks.check_accelerator(trainer.accelerator)  # the launch is complete by now
        cb.resume_from = resolve_resume(trainer, train_args, train_kwargs or {})


class OneBitTrainer(Trainer):
    """``transformers.Trainer`` that trains with hf_onebit's optimizers (see the module docstring).

    With any other ``--optim`` it is the stock Trainer, except for :func:`fix_loss_kwargs`.
    """

    def __init__(self, model=None, args=None, *more, **kwargs):
        if model is not None and args is not None and is_onebit_name(getattr(args, "optim", None)):
            checks.refuse_arguments(args)
            checks.check_model(model)  # before the Trainer moves or wraps it
        super().__init__(model, args, *more, **kwargs)
        fix_loss_kwargs(self)
        enable(self)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        if is_onebit_name(getattr(args, "optim", None)):
            return optimizer_kwargs(args.optim, args)
        return Trainer.get_optimizer_cls_and_kwargs(args, model)

    def train(self, *args, **kwargs):
        before_train(self, args, kwargs)
        return super().train(*args, **kwargs)


__all__ = [
    "OneBitTrainer",
    "OneBitTrainingArguments",
    "before_train",
    "enable",
    "valid_optim_names",
]
