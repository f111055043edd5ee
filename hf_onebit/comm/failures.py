"""When a communication job fails: say where, and whether a peer or this rank is to blame.

A collective that fails because another rank died surfaces on the survivors as a gloo/NCCL
error or a timeout, often minutes later and with no hint of the cause. A job that fails on this
rank for a local reason (a kernel, memory, a bug) makes every *other* rank time out, and they
would blame the network. So every hf_onebit job is wrapped (:func:`with_failure_context`): a
network error becomes a :class:`CommunicationError` that says "another rank has probably died",
anything else a :class:`LocalFailure` that says "not a network error" and how to rule out the
compiled kernels.

On CUDA that split cannot be trusted. A kernel only enqueues its work and returns; so does an
NCCL collective. A fault of a kernel (a Triton kernel of hf_onebit, or any kernel of the
model's forward and backward) is reported by whatever next waits on the device: often the
collective, whose error then reads as a network failure (NCCL says "unhandled cuda error"), or a
later, innocent operation of this rank. So once this process has initialised CUDA, each message
says that the error may come from an earlier kernel on this rank and how to find the one that
failed: ``CUDA_LAUNCH_BLOCKING=1`` makes every kernel report its own error at its launch, and
``NCCL_DEBUG=WARN`` makes NCCL print whether it saw a CUDA error (local) or a lost connection (a
peer). An error that names CUDA itself (``torch.AcceleratorError``, "CUDA error: ...") is never
blamed on a peer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_onebit.kernels import ENV_VAR as KERNELS_ENV


class CommunicationError(RuntimeError):
    """A collective of hf_onebit failed (typically: a peer died or timed out)."""


class LocalFailure(RuntimeError):
    """A communication job failed on this rank for a local reason (kernel, memory), not the network."""


#: words of the errors that gloo, NCCL and the store raise as RuntimeError when a peer is gone
_NETWORK_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "socket", "store")
#: words of an error that the CUDA runtime reported on this rank (NCCL's "unhandled cuda error"
#: included: NCCL passes on a CUDA error it met on this rank's device, not a peer's failure)
_CUDA_WORDS = ("cuda error", "unhandled cuda error", "illegal memory access", "device-side assert",
               "misaligned address", "cudaerror")

#: what a user does to find the kernel that failed, when CUDA reports errors asynchronously
CUDA_ASYNC_HINT = (
    " On CUDA, kernels and NCCL collectives report their errors asynchronously, at the next operation"
    " that waits for the device: this error may come from an earlier kernel on this rank (one of"
    " hf_onebit's Triton kernels or one of the model's), whatever operation raised it. To find out,"
    " rerun with CUDA_LAUNCH_BLOCKING=1 (every kernel then reports its own error where it is launched;"
    " slow, for debugging only) and NCCL_DEBUG=WARN (NCCL then prints whether it met a CUDA error on this"
    f" rank or lost a peer); {KERNELS_ENV}=reference rules out hf_onebit's compiled kernels."
)


def is_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an error the CUDA runtime reported on this rank (whatever raised it)."""
    accelerator_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8
    if accelerator_error and isinstance(exc, accelerator_error):
        return True
    text = str(exc).lower()
    return any(w in text for w in _CUDA_WORDS)


def is_distributed_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from the network or a peer (so another rank is the likely culprit).

    A CUDA error never is, even when NCCL raised it ("unhandled cuda error")."""
    if is_cuda_error(exc):
        return False
    dist_error = getattr(dist, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _NETWORK_WORDS)


def errors_are_asynchronous() -> bool:
    """Whether this process's errors may surface away from their cause: it has initialised CUDA.

    Asked only after a failure (it reads a flag; it initialises nothing)."""
    return torch.cuda.is_initialized()


def with_failure_context(job: Callable[[], Any], where: Callable[[], str]) -> Callable[[], Any]:
    """``job`` whose failure names ``where()`` (rank, step, plan) and what to suspect.

    ``where`` is called only on a failure: nothing is formatted on the hot path."""

    def run():
        try:
            return job()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            place = where()
            on_cuda = errors_are_asynchronous()
            if is_cuda_error(exc):
                raise LocalFailure(
                    f"{place}: the CUDA runtime reported an error on this rank: {type(exc).__name__}: {exc}."
                    " This is not a network error (the other ranks will then time out waiting for this one)."
                    + CUDA_ASYNC_HINT
                ) from exc
            if not is_distributed_failure(exc):  # blame a peer only for what a peer can cause
                raise LocalFailure(
                    f"{place}: the communication job failed on this rank: {type(exc).__name__}: {exc}."
                    " This is not a network error: the kernels, memory or the inputs failed here (the other"
                    f" ranks will then time out waiting for this one). Set {KERNELS_ENV}=reference to rule"
                    " out the compiled kernels; `hf-onebit check` tests them."
                    + (CUDA_ASYNC_HINT if on_cuda else "")
                ) from exc
            if on_cuda:
                raise CommunicationError(
                    f"{place}: a collective failed: {exc}. Either another rank has died or stalled beyond the"
                    " process group's timeout (init_process_group(timeout=...)), or a kernel failed earlier on"
                    " this rank or on a peer and the collective was the first to report it." + CUDA_ASYNC_HINT
                    + " Then stop all ranks and resume from the last checkpoint."
                ) from exc
            raise CommunicationError(
                f"{place}: a collective failed: {exc}. Another rank has"
                " probably died or stalled beyond the process group's timeout"
                " (init_process_group(timeout=...)); stop all ranks and resume from the last checkpoint."
            ) from exc

    return run
