"""Byte and round counters for everything hf_onebit sends.

Accounting rule (the one benchmarks, logs and docs use): *bytes sent by this rank* under the
bandwidth-optimal algorithm of each collective, i.e. what a ring implementation sends:

* all-gather of ``c`` bytes per rank:           ``(n - 1) * c`` sent, ``(n - 1) * c`` received
* all-to-all of ``B`` bytes per rank:           ``(n - 1) / n * B`` sent and received
* all-reduce of ``B`` bytes (reduce-scatter + all-gather): ``2 * (n - 1) / n * B`` each way

``fp32_equivalent`` counts what a plain fp32 all-reduce of the same elements would have sent, so
``compression_ratio = fp32_equivalent / sent``. A *round* is one collective call: on a slow
network each round costs at least one latency, whatever its size.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


def allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size if world_size > 1 else 0


@dataclass
class CommRecord:
    """Counters of one call, or the running totals of many."""

    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    fp32_equivalent: int = 0
    calls: int = 0

    @property
    def compression_ratio(self) -> float:
        """``fp32_equivalent / bytes_sent`` (1.0 when nothing was sent)."""
        return self.fp32_equivalent / self.bytes_sent if self.bytes_sent else 1.0

    def __iadd__(self, other: "CommRecord") -> "CommRecord":
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.rounds += other.rounds
        self.fp32_equivalent += other.fp32_equivalent
        self.calls += other.calls
        return self

    def __sub__(self, other: "CommRecord") -> "CommRecord":
        """What was counted since ``other`` (an earlier snapshot of the same totals)."""
        return CommRecord(**{k: v - getattr(other, k) for k, v in asdict(self).items()})

    def as_dict(self) -> dict:
        return {**asdict(self), "compression_ratio": self.compression_ratio}


class CommStats:
    """Thread-safe running totals (calls finish on the communication thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = CommRecord()

    def record(self, call: CommRecord) -> None:
        with self._lock:
            self.total += call

    def snapshot(self) -> CommRecord:
        """A copy of the running totals, safe to read while calls are in flight."""
        with self._lock:
            return CommRecord(**asdict(self.total))

    def restore(self, total: CommRecord) -> None:
        """Continue counting from ``total`` (a resumed run)."""
        with self._lock:
            self.total = CommRecord(**asdict(total))
