"""A DeepSpeed config of a 1-bit optimizer as hf_onebit arguments (``hf-onebit from-deepspeed``).

DeepSpeed's ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb`` (last in ``deepspeed==0.19.6``) were
configured in a JSON file::

    {"train_micro_batch_size_per_gpu": 16,
     "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "freeze_step": 23000, ...}},
     "gradient_clipping": 1.0, "fp16": {"enabled": true}}

:func:`convert` turns such a config into a :class:`Conversion`: the hf_onebit optimizer's keyword
arguments, the launcher's flags and one note per difference, each naming its key. It reproduces
DeepSpeed's behaviour: ``defaults="paper"`` with DeepSpeed's numbers, its freeze step shifted by
its one-ahead step counter, ``bias_correction=False`` (DeepSpeed never applied it); the library
defaults are the alternative. What cannot be honoured (ZeRO stage > 0, ``amsgrad``, an unknown
parameter or optimizer) raises :class:`ConversionError`. :mod:`.from_deepspeed` prints it all.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

from hf_onebit.integrations.defaults import NO_CLIPPING
from hf_onebit.integrations.options import FROM_TRAINING_ARGS, ONEBIT_OPTIMIZERS
from hf_onebit.optim.defaults import LIBRARY

_COMMON = dict(lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
               weight_decay=0.0, max_grad_norm=0.0, amsgrad=False, cuda_aware=False, comm_backend_name="nccl")
#: DeepSpeed's constructor parameters of each optimizer, with DeepSpeed's defaults
DEEPSPEED_PARAMS = {
    "OneBitAdam": dict(_COMMON, freeze_step=100000),
    "ZeroOneAdam": dict(_COMMON, var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678,
                        local_step_clipper=16),
    "OneBitLamb": dict(_COMMON, freeze_step=100000, max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9,
                       factor_max=4.0, factor_min=0.5, factor_threshold=0.1),
}
#: DeepSpeed's optimizer type (lower-cased, as DeepSpeed matched it) -> (hf_onebit class, --optim)
TYPES = {spec.cls.__name__.lower(): (spec.cls.__name__, name) for name, spec in ONEBIT_OPTIMIZERS.items()
         if spec.cls.__name__ in DEEPSPEED_PARAMS}
#: the hyperparameters the Trainer's own flags carry (never in --optim_args)
_HYPER = ("lr", "betas", "eps", "weight_decay")
#: DeepSpeed parameters taken over unchanged under the same name, and their type
_SAME = dict(var_update_scaler=int, local_step_scaler=int, local_step_clipper=int, max_coeff=float, min_coeff=float,
             coeff_beta=float, factor_max=float, factor_min=float, factor_threshold=float)
#: DeepSpeed parameters that change nothing here: the note each gets ({text}: the value as the launcher writes it)
_IGNORED_PARAMS = {
    "cuda_aware": "cuda_aware {text}: no equivalent, ignored: hf_onebit communicates through the DDP process group"
                  " (its backend: nccl on GPUs, gloo on CPUs), never through MPI",
    "comm_backend_name": "comm_backend_name {value!r}: no equivalent, ignored: the process group passed to DDP"
                         " (init_process_group's backend) carries the exchange",
    "eps_inside_sqrt": "eps_inside_sqrt {text}: ignored, as DeepSpeed ignored it (its update always added eps outside"
                       " the square root, as here)",
    "max_grad_norm": "optimizer.params.max_grad_norm: ignored, as DeepSpeed's 1-bit optimizers ignored it (clipping"
                     " is the top-level gradient_clipping)",
}
#: top-level keys that do not change the optimizer or the loop: listed as ignored
_NO_EFFECT = ("steps_per_print", "wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor",
              "dump_state", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler",
              "memory_breakdown", "communication_data_type", "activation_checkpointing", "data_types",
              "checkpoint", "elasticity", "autotuning", "zero_allow_untested_optimizer")
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_HANDLED = ("optimizer", "fp16", "bf16", "bfloat16", "gradient_clipping", "zero_optimization", "amp", "scheduler",
            "sparse_gradients", *_BATCH)


class ConversionError(ValueError):
    """The config cannot be converted: what is wrong and what to do instead."""


@dataclass
class Conversion:
    """A DeepSpeed 1-bit optimizer config as hf_onebit arguments (see the module docstring)."""

    deepspeed_type: str  # as written in the config
    cls_name: str  # OneBitAdam, ZeroOneAdam, OneBitLamb
    optim: str  # the launcher's --optim
    kwargs: dict  # constructor keyword arguments (without params): DeepSpeed's behaviour
    library_kwargs: dict  # the alternative: the library defaults with DeepSpeed's hyperparameters
    trainer_flags: list  # [(flag, value or None for a switch)] besides --optim / --optim_args
    precision: str | None = None  # "fp16", "bf16" or None (fp32)
    notes: list = field(default_factory=list)  # [(key, text)]

    @property
    def cls(self):
        return ONEBIT_OPTIMIZERS[self.optim].cls

    def build(self, params, library: bool = False):
        """The optimizer over ``params`` (``library``: the alternative with the library defaults)."""
        return self.cls(params, **(self.library_kwargs if library else self.kwargs))

    def optim_args(self, library: bool = False) -> str:
        """The ``--optim_args`` text: the constructor arguments the Trainer's flags do not carry."""
        kwargs = self.library_kwargs if library else self.kwargs
        return ",".join(f"{k}={_arg_text(v)}" for k, v in kwargs.items() if k not in FROM_TRAINING_ARGS)

    def launcher_args(self, library: bool = False) -> list[str]:
        """``--optim NAME [--optim_args TEXT] FLAG VALUE ...`` for ``hf-onebit run`` / ``-m hf_onebit.run``."""
        text = self.optim_args(library)
        args = ["--optim", self.optim] + (["--optim_args", text] if text else [])
        for flag, value in self.trainer_flags:
            args += [flag] if value is None else [flag, value]
        return args

    def constructor_call(self, library: bool = False) -> str:
        kwargs = self.library_kwargs if library else self.kwargs
        inner = "".join(f", {k}={v!r}" for k, v in kwargs.items())
        return f"opt = hf_onebit.{self.cls_name}(model.parameters(){inner})"

    def note(self, key: str, text: str) -> None:
        self.notes.append((key, text))


def _arg_text(value) -> str:
    """``value`` as ``--optim_args`` and the Trainer's flags read it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def shell_word(arg: str) -> str:
    """``arg`` as a shell word: quoted where it holds a comma or ``=``."""
    return f'"{arg}"' if "," in arg or "=" in arg else arg


def _number(value, key: str, kind=float):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        ok = ok and float(value).is_integer() and value >= 0
    if not ok:
        raise ConversionError(f"{key} must be {'a non-negative integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _enabled(section, name: str):
    """A precision section's ``enabled``: True, False, or "auto" (HF's configs: the Trainer decides)."""
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ConversionError(f"{name} must be an object such as {{\"enabled\": true}}, got {section!r}")
    value = section.get("enabled", False)
    if value != "auto" and not isinstance(value, bool):
        raise ConversionError(f"{name}.enabled must be true, false or \"auto\", got {value!r}")
    return value


def convert(config: dict) -> Conversion:
    """Convert a DeepSpeed config (the parsed JSON) of a 1-bit optimizer; raises :class:`ConversionError`."""
    if not isinstance(config, dict):
        raise ConversionError(f"a DeepSpeed config is a JSON object, got {type(config).__name__}")
    section = config.get("optimizer")
    if not isinstance(section, dict) or "type" not in section:
        raise ConversionError(
            "no \"optimizer\": {\"type\": ..., \"params\": {...}} section: this converts DeepSpeed configs of"
            " OneBitAdam, ZeroOneAdam and OneBitLamb (a script that builds its optimizer in Python has nothing to"
            " convert here)")
    ds_type = section["type"]
    if not isinstance(ds_type, str) or ds_type.lower() not in TYPES:
        raise ConversionError(
            f"optimizer type {ds_type!r} is not one of DeepSpeed's 1-bit optimizers (OneBitAdam, ZeroOneAdam,"
            " OneBitLamb); for a standard optimizer use the Trainer's own --optim (e.g. adamw_torch) or torch.optim")
    cls_name, optim = TYPES[ds_type.lower()]
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ConversionError(f"optimizer.params must be an object, got {params!r}")
    known = DEEPSPEED_PARAMS[cls_name]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConversionError(
            f"optimizer.params: DeepSpeed's {cls_name} has no parameter {', '.join(map(repr, unknown))} (DeepSpeed"
            f" would have refused it too); its parameters: {', '.join(sorted(known))}")
    conv = Conversion(ds_type, cls_name, optim, kwargs={"defaults": "paper"}, library_kwargs={}, trainer_flags=[])
    _optimizer_params(conv, params)
    _validate(conv)
    _training_loop(conv, config)
    return conv


def _optimizer_params(conv: Conversion, params: dict) -> None:
    name, kw = conv.cls_name, conv.kwargs
    defaults = DEEPSPEED_PARAMS[name]
    for key in ("lr", "eps", "weight_decay", "betas"):  # "auto": left to the training arguments
        value = params.get(key)
        if value == "auto":
            conv.note(key, f"{key} \"auto\": left to the training arguments (--{'learning_rate' if key == 'lr' else key}"
                           " or the constructor's default, which is DeepSpeed's)")
        elif value is not None and key != "betas":
            kw[key] = _number(value, f"optimizer.params.{key}")
        elif value is not None:
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ConversionError(f"optimizer.params.betas must be a pair [beta1, beta2], got {value!r}")
            kw["betas"] = tuple(_number(b, "optimizer.params.betas") for b in value)
    for key, kind in _SAME.items():
        if params.get(key) not in (None, "auto"):
            kw[key] = _number(params[key], f"optimizer.params.{key}", kind)

    # the warmup's end: DeepSpeed's counter runs one ahead (docs/deepspeed.md, "Defaults")
    key = "var_freeze_step" if name == "ZeroOneAdam" else "freeze_step"
    given = params.get(key)
    value = defaults[key] if given is None else _number(given, f"optimizer.params.{key}", int)
    said = f"{key} {value}" if given is not None else f"{key} not given: DeepSpeed's default {value}"
    if value - (name != "ZeroOneAdam") < 1:  # see the counter below
        raise ConversionError(f"optimizer.params.{key} {value}: it leaves no warmup step, so Adam's variance would be"
                              " frozen at 0 (every step m/eps); give DeepSpeed's warmup at least one update, or use"
                              f" {key}=\"auto\" here")
    if name == "ZeroOneAdam":  # it ended the variance phase once that counter *exceeded* var_freeze_step
        kw[key] = value
        conv.note(key, f"{said} -> var_freeze_step={value}: DeepSpeed's first step() only allocated buffers, so its step"
                       " counter runs one ahead, and it ended the variance phase once that counter exceeded"
                       f" var_freeze_step: after {value} updates, as here. Its variance-step and sync schedules test"
                       " `counter mod interval` on that counter, so they fall one step apart from hf_onebit's (no"
                       " argument changes that). The library default, var_freeze_step=\"auto\", freezes when the"
                       " variance has settled.")
    else:
        kw[key] = shifted = value - 1
        conv.note(key, f"{said} -> freeze_step={shifted}: DeepSpeed's first step() only allocated buffers, so its step"
                       f" counter runs one ahead and its freeze_step={value} ended the warmup after {shifted} updates,"
                       f" as freeze_step={shifted} does here. The library default, freeze_step=\"auto\", ends the"
                       " warmup when the variance has settled (within 10-40% of the run).")

    bias = params.get("bias_correction", defaults["bias_correction"])
    if name == "OneBitLamb":
        if "bias_correction" in params:
            conv.note("bias_correction", f"bias_correction {_arg_text(bias)}: ignored: DeepSpeed's 1-bit LAMB never"
                                         " applied bias correction, nor does defaults=\"paper\" (the library's"
                                         " default is True)")
    else:
        kw["bias_correction"] = False
        said = "not given (DeepSpeed's default true)" if "bias_correction" not in params else _arg_text(bias)
        what = ("1-bit Adam's warmup then equals AdamW" if name == "OneBitAdam"
                else "0/1 Adam then corrects its variance, which a short variance phase leaves too small")
        conv.note("bias_correction",
                  f"bias_correction {said} -> bias_correction=False: DeepSpeed never applied bias correction,"
                  f" whatever this key said; False reproduces that. hf_onebit's default is True ({what}).")

    conv.note("defaults",
              "defaults=\"paper\": the papers' values of the arguments left out, which are DeepSpeed's: warmup_bits=None"
              f" (the {'variance steps exchange' if name == 'ZeroOneAdam' else 'warmup exchanges'} the gradient at full"
              " precision, as DeepSpeed did; the library's 8 sends 3.6x fewer bytes), update_clip=None (the library's"
              f" {LIBRARY[name]['update_clip']} bounds every coordinate's step at {LIBRARY[name]['update_clip']}·lr once"
              " the variance is frozen), scale_per_tensor=False and"
              " scale_block=None (one compression scale per rank's chunk of a DDP bucket; the library's keep one"
              " per block of 256 elements of each tensor)"
              + (", var_update_scaler=16 and clip_synced_momentum=True (the library's None and False)"
                 if name == "ZeroOneAdam" else "")
              + (", precondition_exchange=False (the 1-bit exchange carries the momentum; the library's True"
                 " divides it by sqrt(v)+eps first and multiplies the average back)" if name != "OneBitLamb" else
                 f", step_bound=None (the library's {LIBRARY[name]['step_bound']} caps the frozen trust ratio at that"
                 " many times LAMB's own ratio of the exchanged update)")
              + ".")
    conv.note("granularity",
              "compression granularity: hf_onebit compresses DDP buckets (about 25 MB each) during backward, where"
              " DeepSpeed compressed " + ("the whole model's momentum as one buffer" if name == "OneBitLamb" else
                                          "each tensor (fp32) or each flat parameter group (fp16)")
              + " after backward; the scales (and so the rounding) differ, the arithmetic does not.")
    conv.note("auto_mask",
              "auto_mask=True (every preset): coordinates whose gradient stays exactly zero are masked automatically,"
              " where DeepSpeed needed an exp_avg_mask in the parameter groups; optimizer.set_mask() takes your own.")

    if params.get("amsgrad"):
        raise ConversionError(f"optimizer.params.amsgrad true: DeepSpeed's {name} refused AMSGrad too, and"
                              " hf_onebit has no AMSGrad variant; remove the key")
    for key, text in _IGNORED_PARAMS.items():
        if key in params:
            conv.note(key, text.format(text=_arg_text(params[key]), value=params[key]))

    # the alternative: DeepSpeed's hyperparameters, every argument the presets decide left to the library's
    conv.library_kwargs = {k: v for k, v in kw.items() if k not in (*LIBRARY[name], "defaults", "bias_correction")}


def _validate(conv: Conversion) -> None:
    """Build the optimizer over a dummy parameter, so a bad value fails here (as the launcher does);
    what the optimizer warns about at construction becomes a note."""
    import torch

    class Collect(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    said: list[str] = []
    logger, handler = logging.getLogger("hf_onebit"), Collect(logging.WARNING)
    for library in (False, True):
        said.clear()
        logger.addHandler(handler)
        propagate, logger.propagate = logger.propagate, False
        try:
            conv.build([torch.nn.Parameter(torch.zeros(1))], library=library)
        except (ValueError, TypeError) as exc:
            raise ConversionError(f"optimizer.params: hf_onebit.{conv.cls_name} refuses them: {exc}") from exc
        finally:
            logger.removeHandler(handler)
            logger.propagate = propagate
        if not library:
            for message in said:
                conv.note("warning", f"hf_onebit warns when it builds this optimizer: {message}")


def _training_loop(conv: Conversion, config: dict) -> None:
    kw, flags, name = conv.kwargs, conv.trainer_flags, conv.cls_name
    ds = DEEPSPEED_PARAMS[name]

    # the Trainer's flags carry DeepSpeed's value (or default) explicitly: the Trainer's own defaults differ
    params = config["optimizer"].get("params", {})
    for key in _HYPER:
        if params.get(key) == "auto":
            continue
        value = kw.get(key, ds[key])
        if key == "betas":
            flags += [("--adam_beta1", _arg_text(float(value[0]))), ("--adam_beta2", _arg_text(float(value[1])))]
        else:
            flags.append((FROM_TRAINING_ARGS[key], _arg_text(float(value))))
    missing = [k for k in _HYPER if k not in params]
    if missing:
        conv.note("optimizer.params", f"{', '.join(missing)} not given: DeepSpeed's defaults, which are the"
                                      " constructor's too (the launcher line passes them, as the Trainer's differ)")
    if float(kw.get("weight_decay", 0.0)) > 0:
        conv.note("weight_decay", "weight_decay: the Trainer exempts biases and LayerNorm weights from decay;"
                                  " DeepSpeed decayed every parameter unless the script passed parameter groups, as"
                                  " model.parameters() does here")

    # ZeRO, apex AMP and sparse gradients: not honoured
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else zero
    if stage not in (0, False, None):
        raise ConversionError(
            f"zero_optimization.stage {stage!r}: DeepSpeed's 1-bit optimizers refused ZeRO too (stage 0 only), and"
            " hf_onebit replaces DDP's all-reduce of a replicated model. Drop zero_optimization and train with"
            " plain DDP (FSDP2 sharded inside each node works in a plain PyTorch loop: docs/api.md)")
    amp = config.get("amp")
    if isinstance(amp, dict) and amp.get("enabled"):
        raise ConversionError("amp.enabled: apex AMP has no equivalent here; use \"fp16\": {\"enabled\": true} (torch's"
                              " GradScaler) or \"bf16\" instead")
    if config.get("sparse_gradients"):
        raise ConversionError("sparse_gradients true: hf_onebit refuses sparse gradients (nn.Embedding(sparse=False),"
                              " or a standard optimizer)")

    # precision
    fp16 = _enabled(config.get("fp16"), "fp16")
    bf16 = _enabled(config.get("bf16", config.get("bfloat16")), "bf16")
    if fp16 is True and bf16 is True:
        raise ConversionError("fp16 and bf16 are both enabled; DeepSpeed refused that too: enable one")
    if fp16 is True or bf16 is True:
        conv.precision = "fp16" if fp16 is True else "bf16"
        flags.append((f"--{conv.precision}", None))
    if fp16 is True:
        section = config["fp16"]
        scale, power = section.get("loss_scale", 0), section.get("initial_scale_power", 16)
        text = ("fp16: --fp16 (the Trainer's GradScaler); in your own loop torch.autocast(\"cuda\", dtype=torch.float16)"
                " with a torch.amp.GradScaler passed to hf_onebit.attach(ddp, opt, grad_scaler=scaler). Moments and"
                " error buffers stay fp32.")
        if scale not in (0, 0.0, None):
            text += (f" loss_scale {scale} (static): not carried over, GradScaler scales dynamically (a static"
                     " scale: GradScaler(init_scale=..., growth_interval=10**9) in your own loop).")
        if power != 16:
            text += f" initial_scale_power {power}: GradScaler(init_scale=2**{power}) in your own loop (the Trainer's starts at 2**16)."
        extra = sorted(set(section) - {"enabled", "loss_scale", "initial_scale_power", "auto_cast"})
        if extra:
            text += f" {', '.join(extra)}: not carried over (GradScaler's growth_interval / backoff_factor are its own)."
        conv.note("fp16", text)
        if name == "OneBitLamb" and scale not in (0, 0.0, None):
            conv.note("loss_scale", "DeepSpeed's 1-bit LAMB required dynamic loss scaling; GradScaler is dynamic")
    elif bf16 is True:
        conv.note("bf16", "bf16: --bf16 (on CPU also --use_cpu); in your own loop torch.autocast(..., dtype=torch.bfloat16)."
                          " Moments and error buffers stay fp32. DeepSpeed verified its 1-bit optimizers under fp16 only.")
    for which, value in (("fp16", fp16), ("bf16", bf16)):
        if value == "auto":
            conv.note(which, f"{which}.enabled \"auto\": as your training arguments say (--{which})")

    # gradient clipping: not an optimizer argument
    clip = config.get("gradient_clipping", 0.0)
    if clip == "auto":
        conv.note("gradient_clipping", "gradient_clipping \"auto\": as your --max_grad_norm says")
    elif name == "OneBitLamb":
        clip = _number(clip, "gradient_clipping")
        flags.append(("--max_grad_norm", _arg_text(clip)))
        conv.note("gradient_clipping", (
            f"gradient_clipping {clip:g} -> --max_grad_norm {clip:g}. After the freeze .grad holds the averaged"
            " momentum, so that is what gets clipped (DeepSpeed clipped the gradient); in your own loop:"
            " torch.nn.utils.clip_grad_norm_ before step()."
        ) if clip else "no gradient_clipping -> --max_grad_norm 0, as DeepSpeed (the Trainer's default clips at 1.0)")
    else:
        clip = _number(clip, "gradient_clipping")
        flags.append(("--max_grad_norm", "0"))
        if clip:
            conv.note("gradient_clipping",
                      f"gradient_clipping {clip:g} -> --max_grad_norm 0: {NO_CLIPPING[conv.optim]} (DeepSpeed clipped"
                      " the gradient, which hf_onebit never holds after the freeze). --max_grad_norm"
                      f" {clip:g} clips that momentum anyway; in your own loop do not clip. The library's"
                      f" update_clip={LIBRARY[conv.cls_name]['update_clip']} bounds each coordinate's step instead.")

    # batch sizes: a per-process batch and accumulation, as DeepSpeed's
    total, micro, accum = (None if config.get(k, "auto") == "auto" else _number(config[k], k, int) for k in _BATCH)
    if micro is not None:
        flags.append(("--per_device_train_batch_size", str(micro)))
    if accum is not None:
        flags.append(("--gradient_accumulation_steps", str(accum)))
    if total is not None:
        if micro is not None and accum is not None:
            what = f"= {micro} x {accum} x the number of processes (DeepSpeed checked it; check your launch)"
        elif micro is not None:
            what = (f"= {micro} x --gradient_accumulation_steps x the number of processes: --gradient_accumulation_steps"
                    f" {total}/({micro} x processes)")
        else:
            what = "= per-process batch x accumulation steps x processes: give --per_device_train_batch_size"
        conv.note("train_batch_size", f"train_batch_size {total} {what}")
    if micro is not None or accum is not None:
        conv.note("batch", "batch sizes: per process, as in DeepSpeed (your own loop: the DataLoader's batch_size;"
                           " accumulate under ddp.no_sync() so the hook runs once per step)")

    # learning-rate schedule
    sched = config.get("scheduler")
    if sched is None:
        flags.append(("--lr_scheduler_type", "constant"))
        conv.note("scheduler", "no scheduler: DeepSpeed kept lr constant -> --lr_scheduler_type constant (the"
                               " Trainer's default decays it linearly)")
    else:
        kind = sched.get("type") if isinstance(sched, dict) else sched
        conv.note("scheduler", f"scheduler {kind!r}: not converted: choose --lr_scheduler_type and --warmup_steps"
                               " (or a torch.optim.lr_scheduler in your own loop); every hf_onebit optimizer follows"
                               " the lr a scheduler sets, step by step")

    # everything else
    known = [k for k in config if k not in _HANDLED and k in _NO_EFFECT]
    other = [k for k in config if k not in _HANDLED and k not in _NO_EFFECT]
    parts = [f"{', '.join(known)}: no effect on the optimizer, ignored"] if known else []
    if other:
        parts.append(f"{', '.join(other)}: not converted, ignored (check that you do not need them)")
    if parts:
        conv.note("ignored", "; ".join(parts))


def load(path: str) -> dict:
    """The parsed JSON config at ``path`` (a :class:`ConversionError` if it cannot be read or parsed)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConversionError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from exc
