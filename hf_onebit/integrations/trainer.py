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
  new names; ``__post_init__`` validates it and lists the valid names on a typo.
* :meth:`OneBitTrainer.get_optimizer_cls_and_kwargs` (a public override point) builds the
  hf_onebit optimizer over the Trainer's usual parameter groups (no weight decay on biases
  and norms); stock LR schedulers drive its learning rate.
* :class:`~hf_onebit.integrations.callbacks.OneBitCallback` attaches the communication hook to
  the DDP model Accelerate created, saves and restores every rank's compression state with
  each checkpoint, and adds the compression figures to the logs.
* Refuses at start-up what hf_onebit cannot serve (:mod:`.checks`).
* Makes the training gradient the plain mean over the global batch for models whose
  ``forward`` takes ``**kwargs`` but whose loss ignores ``num_items_in_batch`` (see
  :func:`fix_loss_kwargs`).
"""

import inspect
import logging
from dataclasses import dataclass, field

from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from transformers.training_args import OptimizerNames

from hf_onebit.integrations import checks
from hf_onebit.integrations.accelerate import check_accelerator, unwrap_optimizer
from hf_onebit.integrations.callbacks import OneBitCallback
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


def refuse_arguments(args) -> None:
    """Refuse FSDP / DeepSpeed requested in the training arguments (before anything is set up)."""
    if getattr(args, "fsdp", None):
        raise checks.UnsupportedSetup(checks.fsdp_message())
    if getattr(args, "deepspeed", None):
        raise checks.UnsupportedSetup(checks.deepspeed_message())


@dataclass
class OneBitTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the hf_onebit optimizers and their hyperparameter flags.

    ``learning_rate``, ``adam_beta1``/``adam_beta2`` (BinSGDM: ``beta = adam_beta1``),
    ``adam_epsilon`` and ``weight_decay`` are the stock arguments. Every other constructor
    argument can be given in ``optim_args`` (``"auto_mask=false,bias_correction=true"``).
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
        default=None, metadata={"help": "zeroone_adam: variance steps before their interval doubles (default 16)."}
    )
    local_step_scaler: int | None = field(
        default=None,
        metadata={"help": "zeroone_adam: local-phase steps before the sync interval doubles (default 32678)."},
    )
    local_step_clipper: int | None = field(
        default=None, metadata={"help": "zeroone_adam: largest interval between syncs (default 16)."}
    )

    def __post_init__(self):
        name = optim_name(self.optim)
        if is_onebit_name(name):
            refuse_arguments(self)
            if self.ddp_find_unused_parameters is None:
                self.ddp_find_unused_parameters = False  # see hf_onebit.integrations.checks.check_find_unused
            # The stock __post_init__ converts `optim` to transformers' OptimizerNames enum, which does
            # not know the hf_onebit names: let it convert a stock name, then put ours back.
            self.optim = _STOCK_OPTIM_DEFAULT
            try:
                super().__post_init__()
            finally:
                self.optim = name
            for note in validate(name, self):  # fail now, not at the first step, on a bad hyperparameter
                announce(note)
            return
        try:
            OptimizerNames(name)
        except ValueError:
            raise ValueError(unknown_optim_message(name)) from None
        given = [f"--{f}" for f in ALL_FLAGS if getattr(self, f) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to hf_onebit optimizers, not to --optim {name}")
        super().__post_init__()

    def set_optimizer(self, name="adamw_torch", learning_rate=5e-5, weight_decay=0, beta1=0.9, beta2=0.999,
                      epsilon=1e-8, args=None):
        """As in ``TrainingArguments``, also for the hf_onebit names."""
        if not is_onebit_name(name):
            return super().set_optimizer(name, learning_rate, weight_decay, beta1, beta2, epsilon, args)
        self.optim = optim_name(name)
        self.learning_rate, self.weight_decay = learning_rate, weight_decay
        self.adam_beta1, self.adam_beta2, self.adam_epsilon = beta1, beta2, epsilon
        self.optim_args = args
        validate(self.optim, self)
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


def check_trainer(trainer) -> None:
    """Start-up refusals for a Trainer about to train with hf_onebit (see :mod:`.checks`)."""
    refuse_arguments(trainer.args)
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise checks.UnsupportedSetup(checks.deepspeed_message())
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        raise checks.UnsupportedSetup(checks.fsdp_message())
    if getattr(trainer, "is_model_parallel", False):
        raise checks.UnsupportedSetup(checks.model_parallel_message("the Trainer found the model split across devices"))
    if trainer.args.n_gpu > 1:
        raise checks.UnsupportedSetup(
            f"hf_onebit does not support torch.nn.DataParallel (one process driving {trainer.args.n_gpu} GPUs):"
            " launch one process per GPU, e.g. accelerate launch --config_file"
            " recipes/accelerate/single_node_multi_gpu.yaml script.py ..."
        )
    if getattr(trainer.args, "enable_jit_checkpoint", False):
        raise checks.UnsupportedSetup(
            "hf_onebit does not support --enable_jit_checkpoint: the SIGTERM checkpoint is written between the"
            " gradient exchange and the optimizer step and without every rank's compression state, so a run"
            " resumed from it would not continue the same trajectory. Use --save_steps."
        )
    if trainer.model is not None:
        checks.check_model(trainer.model)
    check_accelerator(trainer.accelerator)


def loss_uses_num_items(model) -> bool:
    """Whether ``model``'s loss is normalised by the ``num_items_in_batch`` the Trainer passes.

    The Trainer (checked: transformers 5.23) passes ``num_items_in_batch`` to every model whose
    ``forward`` takes ``**kwargs`` and then assumes the loss is a sum over the whole
    accumulated, all-process batch divided by that count: it skips the division by the
    accumulation steps and multiplies by the number of processes. Models that compute a plain
    per-batch mean (BERT sequence classification: ``CrossEntropyLoss()`` in ``forward``, or a
    loss function without that parameter) then get a loss and gradients multiplied by
    accumulation steps x processes. This reads the model: a declared ``accepts_loss_kwargs``
    wins; otherwise ``forward`` must mention ``num_items_in_batch`` or call a
    ``loss_function`` that takes it. When the source cannot be read, keep the Trainer's choice.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    declared = getattr(base, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return True
    if "num_items_in_batch" in source:
        return True
    if "loss_function" in source:
        try:
            return "num_items_in_batch" in inspect.signature(base.loss_function).parameters
        except (TypeError, ValueError, AttributeError):
            return True
    return False


def fix_loss_kwargs(trainer) -> bool:
    """Set ``trainer.model_accepts_loss_kwargs = False`` if the model's loss ignores the item count.

    Then the Trainer divides each micro-batch's mean loss by the accumulation steps and does
    not multiply it by the number of processes, so DDP's average makes the gradient the plain
    mean over the global batch, and the logged loss the plain mean loss. Only done while the
    Trainer's own ``compute_loss`` is used without a ``compute_loss_func``. Returns whether
    it changed anything.
    """
    if not hasattr(trainer, "model_accepts_loss_kwargs"):
        logger.warning(
            "hf_onebit: this transformers' Trainer has no model_accepts_loss_kwargs (checked with 5.23); cannot"
            " check that the loss and gradients are plain means over the global batch"
        )
        return False
    if not trainer.model_accepts_loss_kwargs or getattr(trainer, "compute_loss_func", None):
        return False
    if type(trainer).compute_loss is not Trainer.compute_loss:
        return False  # a custom compute_loss decides its own scaling
    model = trainer.accelerator.unwrap_model(trainer.model) if trainer.model is not None else None
    if model is None or loss_uses_num_items(model):
        return False
    trainer.model_accepts_loss_kwargs = False
    logger.info(
        "hf_onebit: %s's forward takes **kwargs but its loss ignores num_items_in_batch; setting"
        " model_accepts_loss_kwargs=False so the loss and gradients are plain means (not multiplied by"
        " gradient accumulation steps x processes)", type(model).__name__,
    )
    return True


def default_find_unused_off(trainer) -> bool:
    """Build the DDP model with ``find_unused_parameters=False`` unless the user chose.

    transformers 5.23 (``Trainer._build_accelerator_args``) turns it on for every
    ``PreTrainedModel`` without activation checkpointing when ``--ddp_find_unused_parameters``
    is not given; hf_onebit cannot run with it on gloo (:func:`.checks.check_find_unused`).
    Accelerate 1.15 keeps the ``DistributedDataParallelKwargs`` in ``accelerator.ddp_handler``
    and reads it when ``prepare`` builds the DDP model, which happens inside ``train()``, so
    turning it off here, before training, takes effect. Returns whether it changed anything.
    """
    if trainer.args.ddp_find_unused_parameters is not None:
        return False  # the user's choice (True is refused at attach time on gloo)
    handler = getattr(trainer.accelerator, "ddp_handler", None)
    if handler is None or not getattr(handler, "find_unused_parameters", False):
        return False
    handler.find_unused_parameters = False
    logger.info("hf_onebit: building DDP with find_unused_parameters=False (pass --ddp_find_unused_parameters to choose)")
    return True


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
    check_trainer(trainer)
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
        check_accelerator(trainer.accelerator)
        cb.resume_from = resolve_resume(trainer, train_args, train_kwargs or {})


class OneBitTrainer(Trainer):
    """``transformers.Trainer`` that trains with hf_onebit's optimizers (see the module docstring).

    With any other ``--optim`` it is the stock Trainer, except for :func:`fix_loss_kwargs`.
    """

    def __init__(self, model=None, args=None, *more, **kwargs):
        if model is not None and args is not None and is_onebit_name(getattr(args, "optim", None)):
            refuse_arguments(args)
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
    "fix_loss_kwargs",
    "loss_uses_num_items",
    "valid_optim_names",
]
