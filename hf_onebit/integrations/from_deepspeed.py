"""``hf-onebit from-deepspeed DS_CONFIG.json``: print a DeepSpeed 1-bit optimizer config's conversion.

The launcher line and the constructor call reproducing DeepSpeed, every difference key by key,
then the library defaults' alternative; the conversion itself is
:mod:`hf_onebit.integrations.deepspeed_config`'s.
"""

from __future__ import annotations

import sys
import textwrap

from hf_onebit.integrations.deepspeed_config import Conversion, ConversionError, convert, load, shell_word
from hf_onebit.optim.defaults import LIBRARY

USAGE = "usage: hf-onebit from-deepspeed DS_CONFIG.json"
WIDTH = 100  # the printed lines: commands wrapped where bash and Python allow, notes as paragraphs


def _fill(text: str, first: str = "", rest: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False)


def _shell_lines(args: list[str]) -> str:
    """The launcher's arguments, quoted, over lines of at most :data:`WIDTH` joined by `` \\``."""
    words = []  # a flag with its value: never split between lines
    for w in map(shell_word, args):
        if words and not w.startswith("--") and words[-1].startswith("--") and " " not in words[-1]:
            words[-1] = f"{words[-1]} {w}"
        else:
            words.append(w)
    lines = [words[0]]
    for w in words[1:]:
        if len(lines[-1]) + 1 + len(w) > WIDTH - 4:
            lines.append(w)
        else:
            lines[-1] += f" {w}"
    return " \\\n    ".join(lines)


def report(conv: Conversion, path: str) -> str:
    """What the command prints."""
    clip = LIBRARY[conv.cls_name]["update_clip"]
    return "\n".join([
        f"{path}: DeepSpeed {conv.deepspeed_type} -> hf_onebit.{conv.cls_name}, reproducing DeepSpeed's behaviour",
        "",
        "HF Trainer (hf-onebit run / -m hf_onebit.run SCRIPT.py ...):",
        f"  {_shell_lines(conv.launcher_args())}",
        "",
        "Plain PyTorch (DDP, then hf_onebit.attach(ddp, opt)):",
        _fill(conv.constructor_call(), "  ", "      "),  # breaks after commas: still valid Python
        "",
        "Differences from DeepSpeed, key by key:",
        *(_fill(text, "  - ", "    ") for _, text in conv.notes),
        "",
        _fill(f"Or hf_onebit's library defaults (automatic freeze, 8-bit warmup, update_clip={clip}, one scale per"
              " block of 256 elements of each tensor, bias correction), with DeepSpeed's hyperparameters:"),
        f"  {_shell_lines(conv.launcher_args(library=True))}",
        _fill(conv.constructor_call(library=True), "  ", "      "),
    ])


def main(argv: list[str]) -> int:
    """``hf-onebit from-deepspeed DS_CONFIG.json``: print the conversion; 2 on bad input."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\nprints the hf_onebit equivalent of a DeepSpeed config of OneBitAdam, ZeroOneAdam or"
              " OneBitLamb: the launcher's --optim/--optim_args and flags, the constructor call, and every difference")
        return 0 if argv else 2
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        conv = convert(load(argv[0]))
    except ConversionError as exc:
        print(f"hf-onebit from-deepspeed: error: {exc}", file=sys.stderr)
        return 2
    print(report(conv, argv[0]))
    return 0
