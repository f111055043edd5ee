"""The compression and time figures that go into training logs (Trainer ``on_log``, ``accelerator.log``).

Every value is a number, so that every reporter plots it: TensorBoard writes a string as a text
entry at every log step, and MLflow drops it with a warning.

=============================== =================================================================
key                             meaning (all for *this* rank; bytes as :mod:`hf_onebit.comm.stats`)
=============================== =================================================================
``onebit/phase``                the phase of the last step, as a number (:data:`PHASE_CODES`):
                                ``0`` the first phase (1-bit Adam / LAMB ``warmup``, 0/1 Adam
                                ``variance``), ``1`` the last (``compression``, ``local_steps``;
                                BinSGDM, which has one phase, logs 1 throughout), ``-1`` a phase
                                this table does not know. The name is logged once at each change.
``onebit/bytes_per_step``       bytes sent per optimizer step, averaged over the steps since the last log
``onebit/bytes_sent``           bytes sent since the start of training (continues across a resume)
``onebit/compression_ratio``    bytes an fp32 all-reduce of the same collectives would have sent,
                                divided by the bytes sent, over the slowest link: on several nodes
                                the bytes leaving the node (``optimizer.onebit_stats()``'s ratio)
``onebit/inter_node_ratio``     the same ratio for the bytes leaving the node; only on several nodes
``onebit/intra_node_ratio``     the same ratio for the bytes that stay inside the node; only on
                                several nodes
``onebit/inter_node_bytes_sent`` bytes that left the node since the start; only on several nodes
``onebit/ratio_vs_ddp``         bytes plain DDP would have sent (an all-reduce of every gradient at
                                every step) divided by the bytes sent; counts the steps 0/1 Adam skips
``onebit/comm_ms``              milliseconds per optimizer step that the communication jobs ran
                                (compression kernels and collectives), averaged over the steps since
                                the last log
``onebit/compress_ms``          of which in the compression kernels (the jobs' ``pack`` and ``unpack``
                                stages); only where the exchange marks its stages
``onebit/exchange_ms``          of which in the collectives (``exchange`` stages); likewise
``onebit/exchange_wait_ms``     milliseconds per step that training waited for communication: from
                                the hand-over of a step's last job (the end of backward, or inside
                                ``step()``) to the end of its jobs
``onebit/hidden_share``         ``1 - exchange_wait / comm`` over the steps since the last log: the
                                share of communication time hidden behind backward, clipped to 0..1
                                (the wait includes the hand-over to the communication thread, so a
                                model in one DDP bucket shows 0); absent while nothing was communicated
=============================== =================================================================

Ratios are left out while nothing has been sent yet. The time keys cover the steps whose
communication has completed: on CPU every step up to the log; on CUDA the time is read from
events that are never waited for, so a step whose events have not completed by the log is counted
in the next one (see :mod:`hf_onebit.comm.stats`). Times are measured in this process (they start
again from zero after a resume) and include the one-off compilation of the CPU kernels in the first
steps of each phase.

At the end of training :meth:`CompressionLog.summary` gives a one-line report (bytes against fp32
DDP, and the communication time saved at the link speed measured during the run); the Trainer
integration logs it on rank 0.
"""

from __future__ import annotations

import logging
import sys

from hf_onebit.comm import CommRecord, allreduce_bytes
from hf_onebit.comm.stats import TIMER, TimeRecord
from hf_onebit.optim import OneBitOptimizer

PREFIX = "onebit/"
#: the phase names of the optimizers, as the number ``onebit/phase`` logs: 0 the first phase, 1 the last
PHASE_CODES = {"warmup": 0, "variance": 0, "compression": 1, "local_steps": 1, "vote": 1, "local": 1}
#: what the summary says on a single process, where the phases run but nothing is sent
SINGLE_PROCESS = "none (single process)"

logger = logging.getLogger("hf_onebit")


def phase_code(name: str) -> int:
    """``onebit/phase``'s number for the phase ``name`` (``-1`` for a name :data:`PHASE_CODES` lacks)."""
    return PHASE_CODES.get(name, -1)


class CompressionLog:
    """Turns an optimizer's counters and the communication timer into log entries.

    :meth:`start` enables the process's communication timer and marks the end of each optimizer
    step for it (an optimizer step post-hook, public ``torch.optim`` API); :meth:`finish` undoes
    both. :meth:`entries` gives the figures since the previous call.
    """

    def __init__(self, optimizer: OneBitOptimizer) -> None:
        self.optimizer = optimizer
        params = optimizer.params_in_order()
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in params)
        self._phase: str | None = None
        self._hook = None
        self.restart()

    # -- the timer
    def start(self) -> None:
        """Time the communication from now on (idempotent)."""
        if self._hook is None:
            TIMER.enable()
            self._hook = self.optimizer.register_step_post_hook(lambda *_: TIMER.mark_step())
            self._last_times = self._run_times = TIMER.snapshot()

    def finish(self) -> None:
        """Stop timing (the figures read so far stay)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            TIMER.disable()

    def note_step_start(self) -> None:
        """Remember the phase of the step about to run (call before its forward/backward)."""
        self._phase = self.optimizer.phase()

    def total(self) -> CommRecord:
        return self.optimizer.exchange.stats.snapshot()  # restored from the checkpoint on resume

    def restart(self) -> None:
        """Measure the next entries from here (after a resume restored the counters)."""
        self._last_steps = self._run_steps = self.optimizer.steps_done
        self._last_sent = self.total().bytes_sent
        self._last_times = self._run_times = TIMER.snapshot()

    # -- per log step
    def entries(self) -> dict:
        """The log entries now, all numbers; per-step figures cover the steps since the previous call."""
        opt = self.optimizer
        total = self.total()
        steps = opt.steps_done - self._last_steps
        out: dict = {f"{PREFIX}phase": phase_code(self._phase or opt.phase())}
        if steps > 0:
            out[f"{PREFIX}bytes_per_step"] = (total.bytes_sent - self._last_sent) / steps
        out[f"{PREFIX}bytes_sent"] = total.bytes_sent
        if total.bytes_sent:
            out[f"{PREFIX}compression_ratio"] = total.headline_ratio
            out[f"{PREFIX}ratio_vs_ddp"] = self.ddp_bytes(opt.steps_done) / total.bytes_sent
        if total.inter_node_fp32:  # several nodes
            out[f"{PREFIX}inter_node_bytes_sent"] = total.inter_node_sent
            for key, ratio in (("inter_node_ratio", total.inter_node_ratio), ("intra_node_ratio", total.intra_node_ratio)):
                if ratio is not None:
                    out[f"{PREFIX}{key}"] = ratio
        self._last_steps, self._last_sent = opt.steps_done, total.bytes_sent
        if self._hook is not None:
            times = TIMER.snapshot()
            out.update(time_entries(times - self._last_times))
            self._last_times = times
        return out

    def ddp_bytes(self, steps: int) -> int:
        """Bytes this rank would send in ``steps`` steps of plain DDP (an all-reduce of every gradient)."""
        return steps * allreduce_bytes(self.gradient_bytes, self.optimizer.world_size)

    # -- at the end
    def summary(self) -> str:
        """One line for the end of training: bytes against fp32 DDP, and the time saved at the measured link.

        Bytes cover the whole training (they continue across a resume); times cover this process.

        The time saved is an estimate. The link speed is that of the fastest communication job
        (one DDP bucket's exchange): its bytes sent divided by its time in collectives (the
        ``exchange`` stages), or by its whole time where the exchange marks no stages (then its
        compression counts as link time). No job moves data faster than the link, so this is a
        lower bound of the link's speed, the tighter the larger the buckets (a small job is
        dominated by latency). fp32 DDP's all-reduce of every gradient at every step of this
        process would take its bytes divided by that speed (its latency is left out); the saving
        is that time minus the time hf_onebit's communication ran, compression included. Both
        overlap with backward, so the wall-clock saving is smaller where DDP's exchange was
        already hidden. Waits for the device's pending timing events (call it once training has
        ended, not in the loop).
        """
        opt = self.optimizer
        name = f"hf_onebit {type(opt).__name__}"
        phase = opt.phase()
        total = self.total()
        if opt.world_size == 1:
            return (f"{name}: {opt.steps_done} steps on one process, ending in phase '{phase}'; communication:"
                    f" {SINGLE_PROCESS}")
        ddp = self.ddp_bytes(opt.steps_done)
        line = (f"{name} on {opt.world_size} ranks, {opt.steps_done} steps, ending in phase '{phase}': this rank"
                f" sent {_bytes(total.bytes_sent)} where fp32 DDP sends {_bytes(ddp)}")
        if total.bytes_sent:
            line += f" ({ddp / total.bytes_sent:.1f}x fewer, {_bytes(ddp - total.bytes_sent)} saved)"
        if total.inter_node_ratio is not None:  # several nodes: the slow link first
            line += (f"; {_bytes(total.inter_node_sent)} of it left the node, {total.inter_node_ratio:.1f}x fewer than"
                     " fp32 all-reduces of the same buckets send between nodes")
        times = TIMER.settle() - self._run_times if self._hook is not None else TimeRecord()
        if times.comm <= 0:
            return line + "; no communication time measured"
        line += (f"; communication ran {times.comm:.2f} s, {times.wait:.2f} s of it exposed"
                 f" ({100 * times.hidden_share:.0f}% hidden behind backward)")
        if times.link_speed <= 0:
            return line
        how = "time in its collectives" if times.link_speed_staged else "time of the whole job, compression included"
        ddp_time = self.ddp_bytes(opt.steps_done - self._run_steps) / times.link_speed
        saved = ddp_time - times.comm
        line += (f"; the link moved at least {_bytes(times.link_speed)}/s (the fastest exchange: bytes sent / {how}),"
                 f" at which fp32 DDP's all-reduce of these steps takes ~{ddp_time:.2f} s: ~{abs(saved):.2f} s of"
                 f" communication time {'saved' if saved >= 0 else 'lost'} (an estimate: see CompressionLog.summary)")
        return line


def time_entries(d: TimeRecord) -> dict:
    """The time keys for the steps counted in ``d`` (a difference of two timer snapshots)."""
    if d.steps <= 0:
        return {}
    out = {
        f"{PREFIX}comm_ms": round(1e3 * d.comm / d.steps, 4),
        f"{PREFIX}exchange_wait_ms": round(1e3 * d.wait / d.steps, 4),
    }
    if d.staged_comm > 0:  # the exchange marked its stages
        out[f"{PREFIX}compress_ms"] = round(1e3 * d.compress / d.steps, 4)
        out[f"{PREFIX}exchange_ms"] = round(1e3 * d.exchange / d.steps, 4)
    share = d.hidden_share
    if share is not None:
        out[f"{PREFIX}hidden_share"] = round(share, 4)
    return out


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def show_info(main_process: bool, level: int | None = None) -> None:
    """Let hf_onebit's INFO messages (phase changes, the chosen freeze step, the summary) reach the console.

    Python prints a library's messages below WARNING nowhere until the script configures logging,
    and stock scripts leave hf_onebit's logger alone. So, unless the user chose a level for the
    ``hf_onebit`` logger, it gets ``level`` (the Trainer passes the one its ``--log_level`` /
    ``--log_level_replica`` give where they were set), by default INFO on the main process and
    WARNING on the others (as the Trainer's replicas); and if no handler would print its records
    (none on it or above it), one that writes the message to stderr. To silence it:
    ``logging.getLogger("hf_onebit").setLevel(logging.WARNING)`` (or ``--log_level warning``).
    """
    if logger.level == logging.NOTSET:
        logger.setLevel(level if level is not None else logging.INFO if main_process else logging.WARNING)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


_announced: set[str] = set()


def announce(message: str) -> bool:
    """Print ``hf_onebit: message`` to stderr once per process, on rank 0 only (``RANK``/``LOCAL_RANK``).

    For what must reach the user even before the script configured logging (argument parsing,
    the start of training). Returns whether it printed.
    """
    import os

    if message in _announced:
        return False
    _announced.add(message)
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) != "0":
        return False
    print(f"hf_onebit: {message}", file=sys.stderr, flush=True)
    return True
