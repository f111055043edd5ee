"""``python -m hf_onebit.check``: see :mod:`hf_onebit.check`."""

import os
import sys

import torch.distributed as dist

from hf_onebit.check import main

code = main()
if dist.is_initialized():  # a part failed: a collective may be pending, so no teardown (see check._launched)
    sys.stdout.flush()
    os._exit(code)
sys.exit(code)
