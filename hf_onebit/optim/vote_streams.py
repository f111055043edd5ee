"""Counter-based random streams for BinSGDM's votes: the draws depend on nothing but their name.

The uniforms for parameter ``index`` (its position in the optimizer's parameter order) at step
``step`` come from Philox-4x64 (numpy) with key ``(seed, stream)`` and counter
``[0, 0, index, step]``; ``stream`` is the rank for worker votes and ``2**32 + node`` for node
votes (:data:`NODE_STREAM`). They do not change when DDP rebuilds its buckets (the first
iteration after a resume uses another layout than the uninterrupted run), when buckets complete
in another order, or when a step is skipped and retried: a resumed run draws exactly the numbers
the uninterrupted run draws, with no generator state to save. Every device draws the same
numbers: a bucket's draws are one call of the kernel backend's ``vote_uniform`` (numba on CPU,
Triton on CUDA, both bitwise numpy's Philox, see :func:`hf_onebit.kernels.reference.vote_uniform`).
"""

from __future__ import annotations

import numpy as np
import torch

NODE_STREAM = 1 << 32  # node streams: 2**32 + node (worker streams are the rank)
#: stratified votes (BinSGDM's ``stratified_votes``): worker votes 2**33 + node (0 when flat), node votes
#: 2**33 + 2**32, each stream shared by the ranks (nodes) whose votes are averaged together
STRATIFIED_STREAM = 1 << 33
MASK64 = (1 << 64) - 1


class VoteStream:
    """Counter-based uniforms in ``[0, 1)`` for one stream: ``(seed, stream, step, index)``.

    Philox-4x64 with key ``(seed, stream)`` and counter ``[0, 0, index, step]`` (numpy), i.e.
    ``np.random.Generator(np.random.Philox(key=..., counter=...)).random(n, float32)``.
    """

    def __init__(self, seed: int, stream: int) -> None:
        self.seed = int(seed)
        self.stream = int(stream)
        self._key = np.array([self.seed, self.stream], dtype=np.uint64)
        self._bitgen = np.random.Philox(key=self._key)
        self._gen = np.random.Generator(self._bitgen)

    def uniform_many_(self, out: torch.Tensor, step: int, kernels, table) -> torch.Tensor:
        """:meth:`uniform_` of ``(step, index)`` for every piece of a bucket at once, through the
        kernel backend ``kernels`` (``vote_uniform``; ``table`` its ``vote_uniform_table`` of the
        pieces' offsets and indices): one numba call on CPU, one Triton launch on CUDA, bitwise
        numpy's numbers on every device."""
        kernels.vote_uniform(out, table, seed=self.seed, stream=self.stream, step=step)
        return out

    def uniform_(self, out: torch.Tensor, step: int, index: int) -> torch.Tensor:
        """Fill the contiguous fp32 tensor ``out`` with the draws of ``(step, index)`` (numpy's,
        on the host; copied to other devices: the optimizer draws whole buckets with
        :meth:`uniform_many_`)."""
        if out.device.type != "cpu":
            return out.copy_(self.uniform_(torch.empty(out.shape, dtype=torch.float32), step, index))
        self._bitgen.state = {
            "bit_generator": "Philox",
            "state": {"counter": np.array([0, 0, index, step], dtype=np.uint64), "key": self._key},
            "buffer": np.zeros(4, dtype=np.uint64),
            "buffer_pos": 4,
            "has_uint32": 0,
            "uinteger": 0,
        }
        self._gen.random(out=out.numpy(), dtype=np.float32)
        return out
