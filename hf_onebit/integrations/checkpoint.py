"""Per-rank compression state beside a Trainer / Accelerate checkpoint.

Named for what they take, a *checkpoint* directory, unlike :mod:`hf_onebit.checkpoint`'s
``save_rank_state`` / ``load_rank_state``, which take the folder the files go in.

HF Trainer and ``accelerator.save_state`` write the optimizer from rank 0 only
(``optimizer.state_dict()``, identical on every rank for hf_onebit). What differs per rank is
written by every rank with :func:`hf_onebit.checkpoint.save_rank_state` into ::

    <checkpoint>/hf_onebit/hf_onebit_rank{r}_of{n}.{pt,json}

and verified and read back on the same rank by :func:`hf_onebit.checkpoint.load_rank_state`,
after the optimizer's ``load_state_dict`` and after the hook is attached. The per-rank state
also carries this rank's cumulative traffic counters, so logged totals continue across a resume.
"""

from __future__ import annotations

import glob
import os

from hf_onebit import checkpoint as core
from hf_onebit.optim import OneBitOptimizer

SUBDIR = "hf_onebit"


def rank_state_dir(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, SUBDIR)


def checkpoint_has_rank_state(checkpoint_dir: str) -> bool:
    return bool(glob.glob(os.path.join(rank_state_dir(checkpoint_dir), "hf_onebit_rank*_of*.pt")))


def save_beside_checkpoint(optimizer: OneBitOptimizer, checkpoint_dir: str) -> str:
    """Write this rank's state into ``checkpoint_dir``'s ``hf_onebit/`` folder; returns the file written. Every rank must call it (no collective)."""
    return core.save_rank_state(optimizer, rank_state_dir(checkpoint_dir))


def load_from_checkpoint(optimizer: OneBitOptimizer, checkpoint_dir: str) -> None:
    """Restore this rank's state from ``checkpoint_dir``'s ``hf_onebit/`` folder (refuses missing, foreign or corrupt files).

    Call after ``optimizer.load_state_dict`` (from the same checkpoint) and after
    :func:`hf_onebit.attach` (which tells the optimizer its process group).
    """
    core.load_rank_state(optimizer, rank_state_dir(checkpoint_dir))
