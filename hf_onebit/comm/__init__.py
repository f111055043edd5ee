"""Collectives over torch.distributed: compressed and full-precision all-reduce, in one order."""

from hf_onebit.comm.allreduce import MeanAllReduce
from hf_onebit.comm.compressed import CompressedAllReduce
from hf_onebit.comm.pieces import padded_length
from hf_onebit.comm.executor import executor_for, runs_inline
from hf_onebit.comm.stats import CommRecord, CommStats, allreduce_bytes

__all__ = [
    "CommRecord",
    "CommStats",
    "CompressedAllReduce",
    "MeanAllReduce",
    "allreduce_bytes",
    "executor_for",
    "padded_length",
    "runs_inline",
]
