"""Per-rank compression state on disk: one file per rank, verified before it is read.

Optimizer state that is identical on every rank travels in ``optimizer.state_dict()`` (rank 0
saves it, as usual). State that differs per rank (error-feedback buffers, 0/1 Adam's local
parameters and accumulators, BinSGDM's local moments) is saved by *every* rank next to the
checkpoint::

    <dir>/hf_onebit_rank{r}_of{n}.pt     the tensors (read with torch.load(weights_only=True))
    <dir>/hf_onebit_rank{r}_of{n}.json   what it is: format, optimizer, rank, world size, layout, step, sha256

``r`` and ``n`` are the process's global rank and the world size (see :func:`file_rank`).

Loading checks the JSON against this run and the SHA-256 of the ``.pt`` file before touching it,
so a corrupt, modified or foreign file is refused with an error that names it; nothing in it is
ever executed (``weights_only=True`` unpickles tensors and plain containers only).

Policies when the file cannot be used as is (``on_mismatch``):

* ``"error"`` (default): stop with an error that says what is wrong and how to override.
* ``"reset"``: start this rank's compression state afresh (a warning says so): error buffers
  zero, 0/1 Adam accumulators empty and its parameters those of the model checkpoint, BinSGDM
  moments zero. Moments and the frozen variance from ``state_dict()`` are kept. This is also the
  policy for resuming on a different world size or node layout, where error buffers cannot be
  re-split meaningfully (each rank's server error belongs to a chunk that no longer exists).

Every rank must load or every rank must reset: a restored rank splits DDP's first bucket along
its saved segments, a reset one does not, so their exchanges would differ (gloo errors, NCCL
hangs). Loading therefore ends with one small all-gather of each rank's verdict, and when the
ranks disagree (some files usable, some not) *every* rank raises :class:`RankStateError`, under
either policy, naming the ranks and files at fault: restore those files, or start every rank
afresh (``optimizer.reset_rank_state()`` on every rank). ``"reset"`` resets only when every
rank must; under ``"error"`` a rank whose file is unusable raises its own error and the other
ranks raise one naming it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Literal

import torch
import torch.distributed as dist

from hf_onebit.comm.compat import all_gather_bytes
from hf_onebit.optim import saved_state
from hf_onebit.optim.base import OneBitOptimizer, logger

FORMAT_VERSION = 1


def rank_state_paths(directory: str, rank: int, world_size: int) -> tuple[str, str]:
    """Paths of the tensor file and its JSON description for ``rank`` of ``world_size``."""
    stem = os.path.join(directory, f"hf_onebit_rank{rank}_of{world_size}")
    return stem + ".pt", stem + ".json"


def file_rank(optimizer: OneBitOptimizer) -> tuple[int, int]:
    """``(rank, world size)`` that name this process's file: the global ones.

    Not the optimizer's own: under FSDP2 hybrid sharding its group holds one rank per replica,
    so ``optimizer.rank`` repeats across the ranks of a replica, which hold different shards
    (and would write one file over another's).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return optimizer.rank, optimizer.world_size


def shard_size(optimizer: OneBitOptimizer) -> int:
    """Ranks per replica whose shards the error buffers belong to (1: whole tensors, DDP)."""
    return getattr(optimizer.hook_state, "shard_size", 1)


#: The key of a per-rank file's payload under which a caller's own entries travel (``extra``).
EXTRA = "extra"


def _identity(optimizer: OneBitOptimizer) -> dict:
    """What a per-rank file says it belongs to, which loading it must match: the format, the
    optimizer class, this rank among how many, the node layout and the shard size."""
    rank, world = file_rank(optimizer)
    return {"format": FORMAT_VERSION, "optimizer": type(optimizer).__name__, "rank": rank, "world_size": world,
            "nodes": saved_state.node_layout(optimizer), "shard_size": shard_size(optimizer)}


def save_rank_state(optimizer: OneBitOptimizer, directory: str, extra: dict | None = None) -> str:
    """Write this rank's state into ``directory`` (every rank calls this); returns the path.

    ``extra``: more of this rank's values (tensors, numbers, containers) stored in the same
    verified file, read back by :func:`read_rank_state` (:mod:`hf_onebit.sharded_checkpoint`).
    """
    os.makedirs(directory, exist_ok=True)
    rank, world = file_rank(optimizer)
    pt_path, json_path = rank_state_paths(directory, rank, world)
    payload = optimizer.rank_state_dict()
    if extra is not None:
        payload = {**payload, EXTRA: extra}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    meta = {**_identity(optimizer), "steps_done": optimizer.steps_done, "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data)}
    for path, payload, mode in ((pt_path, data, "wb"), (json_path, json.dumps(meta, indent=1), "w")):
        tmp = path + ".tmp"
        with open(tmp, mode) as f:
            f.write(payload)
        os.replace(tmp, path)  # atomic: a crash mid-write never leaves a half file behind
    return pt_path


class RankStateError(RuntimeError):
    """A per-rank state file is missing, foreign, corrupt or from another run shape."""


def _verified_state(optimizer: OneBitOptimizer, pt_path: str, json_path: str) -> dict:
    try:
        with open(json_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise RankStateError(f"cannot read {json_path}: {exc}") from exc
    for key, want in _identity(optimizer).items():
        if key not in meta:
            raise RankStateError(f"{json_path} has no {key!r} entry: not a per-rank state file of this hf_onebit")
        if meta[key] != want:
            raise RankStateError(f"{json_path} is for {key}={meta[key]!r}, this run has {key}={want!r}")
    with open(pt_path, "rb") as f:
        data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta.get("sha256"):
        raise RankStateError(
            f"{pt_path} does not match its checksum in {json_path} (sha256 {digest[:12]}… != "
            f"{str(meta.get('sha256'))[:12]}…): the file is corrupt or was modified; refusing to load it"
        )
    if meta.get("steps_done") != optimizer.steps_done:
        raise RankStateError(
            f"{pt_path} was saved after step {meta.get('steps_done')}, but the optimizer is at step"
            f" {optimizer.steps_done}: load optimizer.state_dict() from the same checkpoint first"
        )
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not our file"
        raise RankStateError(f"{pt_path} is not a valid hf_onebit state file: {exc}") from exc


def load_rank_state(
    optimizer: OneBitOptimizer,
    directory: str,
    on_mismatch: Literal["error", "reset"] = "error",
) -> bool:
    """Restore this rank's state from ``directory``; returns True if it was loaded, False if reset.

    Call it after ``optimizer.load_state_dict(...)`` and after :func:`hf_onebit.attach`, on every
    rank (it ends with one small all-gather: all ranks load, or all reset, or all raise; see the
    module docstring).
    """
    state = read_rank_state(optimizer, directory, on_mismatch)
    if state is None:
        return False
    state.pop(EXTRA, None)
    optimizer.load_rank_state_dict(state)
    return True


def read_rank_state(
    optimizer: OneBitOptimizer,
    directory: str,
    on_mismatch: Literal["error", "reset"] = "error",
) -> dict | None:
    """This rank's verified payload (with ``extra`` under :data:`EXTRA`), not applied yet; ``None``
    after a reset (``on_mismatch="reset"``: the optimizer's per-rank state is started afresh)."""
    if on_mismatch not in ("error", "reset"):
        raise ValueError(f"on_mismatch must be 'error' or 'reset', got {on_mismatch!r}")
    rank, world = file_rank(optimizer)
    pt_path, json_path = rank_state_paths(directory, rank, world)
    state, failure = None, None
    try:
        if not os.path.exists(pt_path):
            others = sorted(f for f in os.listdir(directory) if f.startswith("hf_onebit_rank")) if os.path.isdir(directory) else []
            if others:
                raise RankStateError(
                    f"no per-rank state for rank {rank} of {world} in {directory} (found: {', '.join(others[:4])});"
                    " resuming on another world size cannot reuse error buffers"
                )
            raise RankStateError(f"no per-rank state for rank {rank} of {world}: {pt_path} is missing")
        state = _verified_state(optimizer, pt_path, json_path)
    except RankStateError as exc:
        failure = exc
    # Every rank must decide alike: a restored rank splits DDP's first bucket along its saved
    # segments, a reset one does not, and their exchanges would no longer match (gloo errors,
    # NCCL hangs or reads garbage). One small all-gather, then the same outcome everywhere.
    failed = _failures_on_every_rank(optimizer, None if failure is None else str(failure))
    if failure is not None and on_mismatch == "error":
        raise RankStateError(f"{failure}. To start this rank's compression state afresh instead, pass on_mismatch='reset'.") from failure
    if failed and (on_mismatch == "error" or len(failed) < world):
        listed = "; ".join(f"rank {r}: {why}" for r, why in list(failed.items())[:4])
        more = f" (and {len(failed) - 4} more)" if len(failed) > 4 else ""
        how = " (on_mismatch='reset' resets every rank or none)" if on_mismatch == "reset" else ""
        raise RankStateError(
            f"hf_onebit: rank(s) {sorted(failed)} of {world} cannot use their per-rank state in {directory}"
            f"{more} ({listed}), the other ranks can. Every rank stops: ranks that restore their state and ranks"
            " that start afresh would build different exchanges (different segments) and hang or fail in the next"
            f" backward{how}. Restore the missing or unusable file(s), or start every rank afresh: call"
            " optimizer.reset_rank_state() on every rank instead of loading the per-rank state."
        ) from failure
    if failure is not None:  # on_mismatch="reset", and every rank resets
        logger.warning("hf_onebit: %s; starting rank %d's compression state afresh (on_mismatch='reset')", failure, rank)
        optimizer.reset_rank_state()
        return None
    return state


def _failures_on_every_rank(optimizer: OneBitOptimizer, failure: str | None) -> dict[int, str]:
    """``{rank: why}`` for every rank (global ranks, see :func:`file_rank`) whose per-rank state
    cannot be used: one small all-gather when distributed, so every rank sees the same answer."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {} if failure is None else {file_rank(optimizer)[0]: failure}
    params = optimizer.params_in_order()
    device = params[0].device if params else torch.device("cpu")
    mine = json.dumps(None if failure is None else failure[:300]).encode()
    everyone = [json.loads(b.decode()) for b in all_gather_bytes(mine, device, None)]
    return {r: why for r, why in enumerate(everyone) if why is not None}
