"""Run an unmodified Hugging Face script with the hf_onebit optimizers available.

::

    python -m hf_onebit.run script.py --optim onebit_adam --optim_args "freeze_step=400" ...
    hf-onebit run script.py --optim onebit_adam ...
    python -m hf_onebit.run -m package.module ...            # a module instead of a file

    # several processes: the launcher runs inside each one
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml -m hf_onebit.run script.py ...
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

Runs an unmodified transformers/accelerate script in this process with --optim onebit_adam,
zeroone_adam, onebit_lamb and binsgdm available to the stock TrainingArguments and Trainer.
For several processes start it under a launcher, e.g.
  accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml -m hf_onebit.run SCRIPT.py ...
  torchrun --nproc-per-node 2 -m hf_onebit.run SCRIPT.py ...
See docs/integrations.md."""


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


def main(argv=None) -> None:
    """The ``hf-onebit`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] != "run":
        raise SystemExit(f"hf-onebit: unknown command {argv[0]!r}\n\n{USAGE}")
    run(argv[1:])


if __name__ == "__main__":
    main()
