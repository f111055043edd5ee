"""Run an unmodified Hugging Face script with the hf_onebit optimizers available.

::

    python -m hf_onebit.run script.py --optim onebit_adam --optim_args "freeze_step=400" ...
    hf-onebit run script.py --optim onebit_adam ...
    python -m hf_onebit.run -m package.module ...            # a module instead of a file

    # several processes: the launcher runs inside each one
    hf-onebit config cpu_2proc --write cpu_2proc.yaml        # a launch config shipped with hf_onebit
    accelerate launch --config_file cpu_2proc.yaml -m hf_onebit.run script.py ...
    torchrun --nproc-per-node 2 -m hf_onebit.run script.py ...

In each process it (1) calls :func:`hf_onebit.integrations.patch.install`, the one documented
place where transformers is patched, (2) on a machine without a GPU that was launched with
several processes, sets ``ACCELERATE_USE_CPU=1`` unless it is set (otherwise Accelerate runs
every rank as a lone process), and (3) runs the script as ``__main__`` with ``sys.argv`` set to
``[script, *args]``, as ``python script.py args`` would.
"""

import os
import runpy
import sys

USAGE = """\
usage: hf-onebit run SCRIPT.py [ARGS ...]
       hf-onebit run -m MODULE [ARGS ...]
       python -m hf_onebit.run SCRIPT.py [ARGS ...]
       hf-onebit config --list | NAME [--write PATH]
       hf-onebit check [--device cpu|cuda[:k]] [--size N] [--steps N] [--timeout S] [--no-train] [--json PATH]
       hf-onebit estimate --params 7e9 --gpus 16 --nodes 2 --link 100gbit --step-ms 850
       hf-onebit from-deepspeed DS_CONFIG.json

run:    runs an unmodified transformers/accelerate script in this process with --optim onebit_adam,
        zeroone_adam, onebit_lamb and binsgdm available to the stock TrainingArguments and Trainer.
        For several processes start it under a launcher, e.g.
          hf-onebit config cpu_2proc --write cpu_2proc.yaml
          accelerate launch --config_file cpu_2proc.yaml -m hf_onebit.run SCRIPT.py --optim onebit_adam ...
          torchrun --nproc-per-node 2 -m hf_onebit.run SCRIPT.py --optim onebit_adam ...
config: prints one of the Accelerate launch configs shipped with hf_onebit (--list: their names),
        or writes it to PATH.
check:  the self-check to run first: kernels bit for bit against the reference, their speed against
        copy_, a few DDP steps of each optimizer, host syncs on CUDA; prints a verdict.
estimate: the cost model: bytes and step time of AdamW, PowerSGD and each optimizer, flat and by
        node, warmup and compressed phases, the whole run (docs/cost-model.md; --help: the flags).
from-deepspeed: converts a DeepSpeed config of OneBitAdam, ZeroOneAdam or OneBitLamb: prints the --optim and
        --optim_args for the launcher, the constructor call, and every difference from DeepSpeed.

Started without the launcher, a stock script says
  error: argument --optim: invalid choice: 'onebit_adam' (choose from ...)
because only the launcher adds hf_onebit's names to transformers' --optim choices. Fix: put
"-m hf_onebit.run" before the script (as above), or add
  import hf_onebit.integrations.patch; hf_onebit.integrations.patch.install()
at the top of the script, or use hf_onebit.OneBitTrainingArguments / OneBitTrainer in it.
Needs transformers and accelerate: pip install 'hf-onebit[hf]'. More in the user guide,
Troubleshooting, "argument --optim: invalid choice"."""

def _has_accelerator() -> bool:
    import torch

    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return torch.cuda.is_available()


def _launched_processes() -> int:
    sizes = []
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        try:
            sizes.append(int(os.environ[key]))
        except (KeyError, ValueError):
            pass
    return max(sizes, default=1)


def prepare_environment() -> None:
    """Set ``ACCELERATE_USE_CPU=1`` for a multi-process launch on a machine without a GPU."""
    if _launched_processes() > 1 and "ACCELERATE_USE_CPU" not in os.environ and not _has_accelerator():
        os.environ["ACCELERATE_USE_CPU"] = "1"
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(
                "hf_onebit.run: no GPU and several processes: setting ACCELERATE_USE_CPU=1 so Accelerate"
                " forms a CPU (gloo) process group",
                file=sys.stderr, flush=True,
            )


def run(target: list) -> None:
    """Run ``target`` = ``[script.py, *args]`` or ``["-m", module, *args]`` with the patch installed."""
    if not target or target[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if target else 2)
    prepare_environment()
    from hf_onebit.integrations.patch import install

    install()
    if target[0] == "-m":
        if len(target) < 2:
            raise SystemExit(USAGE)
        module, args = target[1], target[2:]
        sys.argv = [module, *args]
        if "" not in sys.path:
            sys.path.insert(0, "")
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = target[0], target[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"hf_onebit.run: no such script: {script}\n\n{USAGE}")
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
    runpy.run_path(script, run_name="__main__")


CONFIG_USAGE = "usage: hf-onebit config --list | NAME [--write PATH]"


def config_names() -> list[str]:
    """The launch configs shipped with hf_onebit (``hf_onebit/integrations/configs/*.yaml``)."""
    from importlib import resources

    folder = resources.files("hf_onebit.integrations") / "configs"
    return sorted(f.name[: -len(".yaml")] for f in folder.iterdir() if f.name.endswith(".yaml"))


def config_text(name: str) -> str:
    """The text of the shipped launch config ``name`` (``cpu_2proc``, ...)."""
    from importlib import resources

    names = config_names()
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if name not in names:
        raise SystemExit(f"hf-onebit config: no config {name!r}; shipped: {', '.join(names)}")
    return (resources.files("hf_onebit.integrations") / "configs" / f"{name}.yaml").read_text(encoding="utf-8")


def config(argv: list) -> None:
    """``hf-onebit config --list | NAME [--write PATH]``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{CONFIG_USAGE}\n\nshipped configs: {', '.join(config_names())}")
        raise SystemExit(0 if argv else 2)
    if argv == ["--list"]:
        print("\n".join(config_names()))
        return
    name, rest = argv[0], argv[1:]
    text = config_text(name)
    if not rest:
        sys.stdout.write(text)
        return
    if len(rest) != 2 or rest[0] != "--write":
        raise SystemExit(CONFIG_USAGE)
    path = rest[1]
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"hf-onebit config: wrote {path}; use it as: accelerate launch --config_file {path} -m hf_onebit.run"
          " SCRIPT.py ...", file=sys.stderr)


def main(argv=None) -> None:
    """The ``hf-onebit`` console script: ``run``, ``config``, ``check``, ``estimate`` and ``from-deepspeed``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "config":
        config(argv[1:])
        return
    if argv[0] == "check":
        from hf_onebit.check import main as check

        raise SystemExit(check(argv[1:]))
    if argv[0] == "estimate":
        from hf_onebit.estimate import main as estimate

        raise SystemExit(estimate(argv[1:]))
    if argv[0] == "from-deepspeed":
        from hf_onebit.integrations.from_deepspeed import main as from_deepspeed

        raise SystemExit(from_deepspeed(argv[1:]))
    if argv[0] != "run":
        raise SystemExit(f"hf-onebit: unknown command {argv[0]!r}\n\n{USAGE}")
    run(argv[1:])


if __name__ == "__main__":
    main()
