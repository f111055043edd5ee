"""Where the stock Trainer's own choices would hurt a run with hf_onebit, and what is set instead.

Both are checked against transformers 5.23 and Accelerate 1.15, and both leave a user's explicit
choice alone: the loss normalisation (:func:`fix_loss_kwargs`) and DDP's
``find_unused_parameters`` (:func:`default_find_unused_off`).
"""

from __future__ import annotations

import inspect
import logging

from transformers import Trainer

logger = logging.getLogger("hf_onebit")


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
