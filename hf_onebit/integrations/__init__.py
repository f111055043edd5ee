"""Hugging Face integration: Trainer (``--optim onebit_adam``), Accelerate, launcher, logs.

============== ==========================================================================
module         what it holds
============== ==========================================================================
``trainer``    :class:`OneBitTrainingArguments`, :class:`OneBitTrainer` (public Trainer API)
``callbacks``  :class:`OneBitCallback`: attach at train begin, per-rank checkpoints, log keys
``accelerate`` :func:`~hf_onebit.integrations.accelerate.attach` and ``OneBitAccelerator``
               for hand-written Accelerate loops
``options``    the ``--optim`` names and where each hyperparameter comes from
``defaults``   the training-loop settings each optimizer needs that the Trainer's defaults
               lack (no clipping, LAMB's and BinSGDM's lr), what counts as given, the warmup
               alias (the optimizers' own defaults: :mod:`hf_onebit.optim.defaults`)
``checks``     start-up refusals (FSDP, DeepSpeed, model parallel, lone ranks; the hook's own,
               sparse and find_unused, are re-exported from :mod:`hf_onebit.hook.attach_checks`)
``trainer_quirks`` where the stock Trainer's own choices would hurt (loss normalisation,
               ``find_unused_parameters``), and what is set instead
``checkpoint`` ``<checkpoint>/hf_onebit/hf_onebit_rank{r}_of{n}.pt``
``logs``       the ``onebit/...`` log entries
``patch``      the one place transformers is patched (for unmodified scripts)
``launcher``   ``python -m hf_onebit.run`` / ``hf-onebit run``; ``hf-onebit config`` (the launch
               configs shipped in ``configs/``)
``deepspeed_config`` a DeepSpeed 1-bit optimizer config as launcher flags and a constructor call,
               with every difference (needs no transformers)
``from_deepspeed`` ``hf-onebit from-deepspeed``: prints that conversion
``deepspeed_checkpoint`` a DeepSpeed 1-bit Adam / LAMB stage-0 checkpoint's moments, loaded
============== ==========================================================================

Nothing here is imported by ``import hf_onebit``; transformers is imported on first use.
"""

_LAZY = {
    "OneBitTrainer": "hf_onebit.integrations.trainer",
    "OneBitTrainingArguments": "hf_onebit.integrations.trainer",
    "OneBitCallback": "hf_onebit.integrations.callbacks",
    "OneBitAccelerator": "hf_onebit.integrations.accelerate",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name not in ("transformers", "accelerate"):
            raise
        raise ImportError(f"hf_onebit.{name} needs {exc.name}: pip install 'hf-onebit[hf]'") from exc
    return getattr(imported, name)


__all__ = list(_LAZY)
