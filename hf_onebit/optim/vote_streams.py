"""Counter-based random streams for BinSGDM's votes: the draws depend on nothing but their name.

The uniforms for parameter ``index`` (its position in the optimizer's parameter order) at step
``step`` come from Philox-4x64 (numpy) with key ``(seed, stream)`` and counter
``[0, 0, index, step]``; ``stream`` is the rank for worker votes and ``2**32 + node`` for node
votes (:data:`NODE_STREAM`). They do not change when DDP rebuilds its buckets (the first
iteration after a resume uses another layout than the uninterrupted run), when buckets complete
in another order, or when a step is skipped and retried: a resumed run draws exactly the numbers
the uninterrupted run draws, with no generator state to save. CUDA tensors use torch's CUDA
Philox generator seeded with a 64-bit mix of the same four numbers (other numbers than on CPU,
same properties).
"""

from __future__ import annotations

import numpy as np
import torch

NODE_STREAM = 1 << 32  # node streams: 2**32 + node (worker streams are the rank)
MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class VoteStream:
    """Counter-based uniforms in ``[0, 1)`` for one stream: ``(seed, stream, step, index)``.

    CPU: Philox-4x64 with key ``(seed, stream)`` and counter ``[0, 0, index, step]`` (numpy),
    i.e. ``np.random.Generator(np.random.Philox(key=..., counter=...)).random(n, float32)``.
    Other devices: torch's generator for the device seeded with a 64-bit mix of the four.
    """

    def __init__(self, seed: int, stream: int) -> None:
        self.seed = int(seed)
        self.stream = int(stream)
        self._key = np.array([self.seed, self.stream], dtype=np.uint64)
        self._bitgen = np.random.Philox(key=self._key)
        self._gen = np.random.Generator(self._bitgen)
        self._torch_gens: dict[torch.device, torch.Generator] = {}

    def uniform_many_(self, out: torch.Tensor, step: int, offsets: np.ndarray, indices: np.ndarray,
                      pieces: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`uniform_` of ``(step, indices[i])`` into each ``pieces[i]``, the stretch
        ``out[offsets[i]:offsets[i+1]]`` of the flat fp32 ``out``.

        On CPU one numba call draws them all, bitwise numpy's numbers
        (:func:`hf_onebit.kernels.cpu.vote_uniform`): a bucket costs no per-parameter work. Other
        devices draw piece by piece (one ``torch.rand`` each).
        """
        if out.device.type == "cpu":
            from hf_onebit.kernels import cpu  # numba: imported on first use, like the CPU kernels

            cpu.vote_uniform(out, offsets, indices, seed=self.seed, stream=self.stream, step=step)
            return out
        for piece, index in zip(pieces, indices.tolist()):
            self.uniform_(piece, step, index)
        return out

    def uniform_(self, out: torch.Tensor, step: int, index: int) -> torch.Tensor:
        """Fill the contiguous fp32 tensor ``out`` with the draws of ``(step, index)``."""
        if out.device.type == "cpu":
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
        gen = self._torch_gens.get(out.device)
        if gen is None:
            gen = self._torch_gens[out.device] = torch.Generator(device=out.device)
        mixed = _splitmix64(_splitmix64(_splitmix64(self.seed ^ _splitmix64(self.stream)) ^ step) ^ index)
        gen.manual_seed(mixed)
        return torch.rand(out.shape, generator=gen, out=out)
