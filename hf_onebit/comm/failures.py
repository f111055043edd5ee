"""When a communication job fails: say where, and whether a peer or this rank is to blame.

A collective that fails because another rank died surfaces on the survivors as a gloo/NCCL
error or a timeout, often minutes later and with no hint of the cause. A job that fails on this
rank for a local reason (a kernel, memory, a bug) makes every *other* rank time out, and they
would blame the network. So every hf_onebit job is wrapped (:func:`with_failure_context`): a
network error becomes a :class:`CommunicationError` that says "another rank has probably died",
anything else a :class:`LocalFailure` that says "not a network error" and how to rule out the
compiled kernels.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from hf_onebit.kernels import ENV_VAR as KERNELS_ENV


class CommunicationError(RuntimeError):
    """A collective of hf_onebit failed (typically: a peer died or timed out)."""


class LocalFailure(RuntimeError):
    """A communication job failed on this rank for a local reason (kernel, memory), not the network."""


#: words of the errors that gloo, NCCL and the store raise as RuntimeError when a peer is gone
_NETWORK_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "socket", "store")


def is_distributed_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from the network or a peer (so another rank is the likely culprit)."""
    dist_error = getattr(dist, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _NETWORK_WORDS)


def with_failure_context(job: Callable[[], Any], where: Callable[[], str]) -> Callable[[], Any]:
    """``job`` whose failure names ``where()`` (rank, step, plan) and what to suspect.

    ``where`` is called only on a failure: nothing is formatted on the hot path."""

    def run():
        try:
            return job()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            place = where()
            if not is_distributed_failure(exc):  # blame a peer only for what a peer can cause
                raise LocalFailure(
                    f"{place}: the communication job failed on this rank: {type(exc).__name__}: {exc}."
                    " This is not a network error: the kernels, memory or the inputs failed here (the other"
                    f" ranks will then time out waiting for this one). Set {KERNELS_ENV}=reference to rule"
                    " out the compiled kernels; `hf-onebit check` tests them."
                ) from exc
            raise CommunicationError(
                f"{place}: a collective failed: {exc}. Another rank has"
                " probably died or stalled beyond the process group's timeout"
                " (init_process_group(timeout=...)); stop all ranks and resume from the last checkpoint."
            ) from exc

    return run
