"""``python -m hf_onebit.run script.py [args ...]``: run an unmodified HF script with hf_onebit.

The stock ``TrainingArguments`` / ``HfArgumentParser`` then accept ``--optim onebit_adam``,
``zeroone_adam``, ``onebit_lamb`` and ``binsgdm``, and the stock ``Trainer`` builds the hf_onebit
optimizer and attaches its communication hook. See :mod:`hf_onebit.integrations.launcher`.
"""

import sys

from hf_onebit.integrations.launcher import run

if __name__ == "__main__":
    run(sys.argv[1:])
