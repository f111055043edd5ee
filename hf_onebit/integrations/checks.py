"""Start-up refusals: what hf_onebit cannot serve, said before any step runs, naming the alternative.

hf_onebit replaces DDP's gradient all-reduce. It needs every rank to hold the whole model in
one DistributedDataParallel module, and every launched process to be a member of the process
group. Each check raises :class:`UnsupportedSetup` (a ``ValueError``) with the fix. The checks
that need only the DDP model live one layer down, in :mod:`hf_onebit.hook.attach_checks`
(``attach`` runs them for plain-PyTorch users); they are run here too, before anything is wrapped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

# the hook layer's refusals, re-exported: the integrations run them before anything is wrapped
from hf_onebit.hook.attach_checks import UnsupportedSetup, check_compiled_autograd, check_find_unused, check_sparse

__all__ = [
    "UnsupportedSetup", "check_accelerator", "check_compiled_autograd", "check_distributed_type", "check_find_unused",
    "check_launch", "check_model", "check_sparse", "check_trainer", "deepspeed_message", "fsdp_message",
    "model_parallel_message", "note_fsdp_not_run", "refuse_arguments",
]

DOCS = "the user guide, Integrations, section Refusals"


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        return None


def check_launch(num_processes: int, env: Mapping[str, str] | None = None, dist_initialized: bool | None = None) -> None:
    """Refuse when the launcher started several processes that do not train together.

    ``torchrun``/``accelerate launch`` export ``WORLD_SIZE`` (and ``LOCAL_WORLD_SIZE``) to every
    process they start. If this process was started as one of several, but Accelerate runs it
    as a single process (or no process group exists), each rank would train alone and nothing
    would be communicated: on a machine without a GPU, Accelerate does this when
    ``ACCELERATE_USE_CPU`` is not set.
    """
    env = os.environ if env is None else env
    if dist_initialized is None:
        dist_initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    launched = max(_env_int(env, "WORLD_SIZE") or 1, _env_int(env, "LOCAL_WORLD_SIZE") or 1)
    if launched <= 1:
        return
    if dist_initialized and num_processes > 1:
        return
    how = "no torch.distributed process group exists" if not dist_initialized else (
        f"Accelerate runs it as {num_processes} process(es)"
    )
    raise UnsupportedSetup(
        f"hf_onebit: this process was launched as one of {launched} (WORLD_SIZE/LOCAL_WORLD_SIZE), but {how}:"
        " every rank would train alone and nothing would be communicated. On a machine without a GPU"
        " Accelerate only forms a CPU process group when ACCELERATE_USE_CPU=1 is set: run"
        " `ACCELERATE_USE_CPU=1 accelerate launch --config_file cpu_2proc.yaml script.py ...` (the config:"
        " `hf-onebit config cpu_2proc --write cpu_2proc.yaml`),"
        " or start the script through `python -m hf_onebit.run script.py ...` (it sets ACCELERATE_USE_CPU=1"
        f" when there is no GPU). Note that `accelerate launch --cpu` starts a single process. See {DOCS}."
    )


def check_distributed_type(distributed_type, parallelism_config=None) -> None:
    """Refuse FSDP, DeepSpeed, Megatron-LM and Accelerate's tensor/context/sequence parallelism."""
    kind = str(getattr(distributed_type, "value", distributed_type) or "").upper()
    if kind == "FSDP":
        raise UnsupportedSetup(fsdp_message())
    if kind == "DEEPSPEED":
        raise UnsupportedSetup(deepspeed_message())
    if kind == "MEGATRON_LM":
        raise UnsupportedSetup(model_parallel_message("Accelerate runs Megatron-LM (tensor/pipeline parallel)"))
    if parallelism_config is not None:
        sizes = {
            k: getattr(parallelism_config, f"{k}_size", 1) or 1
            for k in ("tp", "cp", "sp", "dp_shard")
        }
        used = {k: v for k, v in sizes.items() if v > 1}
        if used:
            what = ", ".join(f"{k}_size={v}" for k, v in used.items())
            raise UnsupportedSetup(model_parallel_message(f"Accelerate's parallelism_config shards the model ({what})"))


def fsdp_message() -> str:
    return (
        "hf_onebit's Trainer/Accelerate integration does not support FSDP yet: Accelerate shards the model"
        " itself (for HSDP on a 2-D mesh whose full-precision replica all-reduce hf_onebit cannot replace)."
        " Use plain DDP (drop --fsdp / `distributed_type: FSDP`; e.g."
        " the shipped config single_node_multi_gpu: `hf-onebit config single_node_multi_gpu --write ddp.yaml`),"
        " or keep FSDP with a standard optimizer such as"
        " --optim adamw_torch. In a plain PyTorch loop, FSDP2 sharded inside each node works with"
        " hf_onebit.attach (the user guide, API reference, 'With FSDP2')."
    )


def deepspeed_message() -> str:
    return (
        "hf_onebit does not support DeepSpeed (ZeRO or otherwise): it works on plain PyTorch DDP. Drop"
        " --deepspeed / `distributed_type: DEEPSPEED` and launch with plain DDP (e.g."
        " the shipped config single_node_multi_gpu: `hf-onebit config single_node_multi_gpu --write ddp.yaml`)"
        " and --optim onebit_adam / zeroone_adam / onebit_lamb. Coming from DeepSpeed's own 1-bit optimizers (the last"
        " release with them was 0.19.6): `hf-onebit from-deepspeed ds_config.json` prints the equivalent --optim"
        " and --optim_args (the user guide, 'Coming from DeepSpeed')."
    )


def model_parallel_message(what: str) -> str:
    return (
        f"hf_onebit does not support tensor, pipeline or other model parallelism ({what}): it compresses"
        " the gradient all-reduce of data-parallel training, where every rank holds the whole model in"
        " one DistributedDataParallel module. Load the model on one device per process (no"
        " device_map='auto', no tp_plan) and launch one process per device, e.g. with"
        " the shipped config single_node_multi_gpu (`hf-onebit config single_node_multi_gpu --write ddp.yaml`);"
        " for a model that does not fit on one device use"
        " FSDP or DeepSpeed with a standard optimizer."
    )


def check_model(model: torch.nn.Module) -> None:
    """Refuse a model split across devices (device_map, tp_plan, DTensor) or with sparse gradients."""
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, Mapping):
        places = {str(v) for v in device_map.values()}
        if len(places) > 1 or places & {"disk", "meta"}:
            raise UnsupportedSetup(model_parallel_message(
                f"the model was loaded with a device_map that places it on {sorted(places)}"
            ))
    for attr, what in (("tp_size", "tensor parallel (tp_plan)"), ("fsdp_size", "sharded at load time")):
        try:
            size = getattr(model, attr, None)
        except Exception:  # noqa: BLE001 - a property that is not set up
            size = None
        if isinstance(size, int) and size > 1:
            raise UnsupportedSetup(model_parallel_message(f"the model is {what}, {attr}={size}"))
    if getattr(model, "is_distributed_loading_by_transformers", False):
        raise UnsupportedSetup(model_parallel_message("the model was sharded by from_pretrained(distributed_config=...)"))
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        DTensor = ()  # type: ignore[assignment]
    if DTensor and any(isinstance(p, DTensor) for p in model.parameters()):
        raise UnsupportedSetup(model_parallel_message("the model has DTensor parameters (tensor parallel or FSDP2)"))
    check_sparse(model)


def note_fsdp_not_run(distributed_type, env: Mapping[str, str] | None = None) -> bool:
    """Say once when the launch asked for FSDP but Accelerate runs something else. Returns whether it said so.

    ``accelerate launch`` with ``distributed_type: FSDP`` exports ``ACCELERATE_USE_FSDP=true``;
    Accelerate (checked: 1.15) turns it into FSDP only on accelerator devices (GPU, XPU, ...). On
    CPU processes it runs plain DDP (``MULTI_CPU``) without a word: hf_onebit then compresses DDP
    as usual, and the user should know the model is not sharded.
    """
    env = os.environ if env is None else env
    kind = str(getattr(distributed_type, "value", distributed_type) or "").upper()
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or kind == "FSDP":
        return False
    from hf_onebit.integrations.logs import announce

    return announce(
        f"the launch asked for FSDP (distributed_type: FSDP), but Accelerate runs {kind or 'no distributed mode'}:"
        " it shards models only on GPUs and other accelerators, not on CPU processes. This run is plain DDP,"
        f" which hf_onebit compresses as usual; the model is not sharded. See {DOCS}."
    )


def check_accelerator(accelerator) -> None:
    """Refuse launches and Accelerate modes hf_onebit cannot serve."""
    check_launch(accelerator.num_processes)
    check_distributed_type(accelerator.distributed_type, getattr(accelerator, "parallelism_config", None))
    note_fsdp_not_run(accelerator.distributed_type)


def refuse_arguments(args) -> None:
    """Refuse FSDP / DeepSpeed requested in the training arguments (before anything is set up)."""
    if getattr(args, "fsdp", None):
        raise UnsupportedSetup(fsdp_message())
    if getattr(args, "deepspeed", None):
        raise UnsupportedSetup(deepspeed_message())


def check_trainer(trainer) -> None:
    """Start-up refusals for a ``transformers.Trainer`` about to train with hf_onebit."""
    refuse_arguments(trainer.args)
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise UnsupportedSetup(deepspeed_message())
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        raise UnsupportedSetup(fsdp_message())
    if getattr(trainer, "is_model_parallel", False):
        raise UnsupportedSetup(model_parallel_message("the Trainer found the model split across devices"))
    if trainer.args.n_gpu > 1:
        raise UnsupportedSetup(
            f"hf_onebit does not support torch.nn.DataParallel (one process driving {trainer.args.n_gpu} GPUs):"
            " launch one process per GPU, e.g. accelerate launch --config_file"
            " ddp.yaml script.py ... (the config: `hf-onebit config single_node_multi_gpu --write ddp.yaml`)"
        )
    if getattr(trainer.args, "enable_jit_checkpoint", False):
        raise UnsupportedSetup(
            "hf_onebit does not support --enable_jit_checkpoint: the SIGTERM checkpoint is written between the"
            " gradient exchange and the optimizer step and without every rank's compression state, so a run"
            " resumed from it would not continue the same trajectory. Use --save_steps."
        )
    if trainer.model is not None:
        check_model(trainer.model)
    check_accelerator(trainer.accelerator)
