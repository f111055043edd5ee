"""The compression figures that go into training logs (Trainer ``on_log``, ``accelerator.log``).

======================== ======================================================================
key                      meaning (all counted for *this* rank, as :mod:`hf_onebit.comm.stats`)
======================== ======================================================================
``onebit/phase``         the optimizer's phase during the last step (``warmup``, ``compression``,
                         ``variance``, ``local_steps``, ...)
``onebit/bytes_per_step`` bytes sent per optimizer step, averaged over the steps since the last log
``onebit/bytes_sent``    bytes sent since the start of training (continues across a resume)
``onebit/compression_ratio`` bytes an fp32 all-reduce of the same collectives would have sent,
                         divided by the bytes sent (``optimizer.onebit_stats()``'s ratio)
``onebit/ratio_vs_ddp``  bytes plain DDP would have sent (an fp32 all-reduce of every gradient at
                         every step) divided by the bytes sent; counts the steps 0/1 Adam skips
``onebit/communication`` only on a single process: ``none (single process)``; the optimizer's
                         phases still change its update rule, but nothing is sent or compressed
======================== ======================================================================

Ratios are left out while nothing has been sent yet.
"""

from __future__ import annotations

from hf_onebit.comm import CommRecord, allreduce_bytes
from hf_onebit.optim import OneBitOptimizer

PREFIX = "onebit/"
#: ``onebit/communication`` on a single process, where the phases run but nothing is sent
SINGLE_PROCESS = "none (single process)"


class CompressionLog:
    """Turns an optimizer's counters into log entries; remembers the last logged point."""

    def __init__(self, optimizer: OneBitOptimizer) -> None:
        self.optimizer = optimizer
        params = optimizer.params_in_order()
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in params)
        self._last_steps = optimizer.steps_done
        self._last_sent = self.total().bytes_sent
        self._phase: str | None = None

    def note_step_start(self) -> None:
        """Remember the phase of the step about to run (call before its forward/backward)."""
        self._phase = self.optimizer.phase()

    def total(self) -> CommRecord:
        return self.optimizer.comm_stats.snapshot()  # restored from the checkpoint on resume

    def restart(self) -> None:
        """Measure the next entries from here (after a resume restored the counters)."""
        self._last_steps = self.optimizer.steps_done
        self._last_sent = self.total().bytes_sent

    def entries(self) -> dict:
        """The log entries now; ``bytes_per_step`` covers the steps since the previous call."""
        opt = self.optimizer
        total = self.total()
        steps = opt.steps_done - self._last_steps
        out: dict = {f"{PREFIX}phase": self._phase or opt.phase()}
        if opt.world_size == 1:
            out[f"{PREFIX}communication"] = SINGLE_PROCESS
        if steps > 0:
            out[f"{PREFIX}bytes_per_step"] = (total.bytes_sent - self._last_sent) / steps
        out[f"{PREFIX}bytes_sent"] = total.bytes_sent
        if total.bytes_sent:
            out[f"{PREFIX}compression_ratio"] = total.fp32_equivalent / total.bytes_sent
            ddp = opt.steps_done * allreduce_bytes(self.gradient_bytes, opt.world_size)
            out[f"{PREFIX}ratio_vs_ddp"] = ddp / total.bytes_sent
        self._last_steps, self._last_sent = opt.steps_done, total.bytes_sent
        return out


_announced: set[str] = set()


def announce(message: str) -> bool:
    """Print ``hf_onebit: message`` to stderr once per process, on rank 0 only (``RANK``/``LOCAL_RANK``).

    For what must reach the user even before the script configured logging (argument parsing,
    the start of training). Returns whether it printed.
    """
    import os
    import sys

    if message in _announced:
        return False
    _announced.add(message)
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) != "0":
        return False
    print(f"hf_onebit: {message}", file=sys.stderr, flush=True)
    return True
