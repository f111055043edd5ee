"""What only the numba CPU backend has: BinSGDM's fused worker math, its vote packing, and the
digest that keeps numba's cache of the loop files in step with the code they share.

The compression operations it shares with the other backends are checked against the reference
for every backend in ``test_backend_*.py``.
"""

from __future__ import annotations

import pytest
import torch

from hf_onebit.kernels import cpu
from hf_onebit.kernels import reference as ref


# ---------------------------------------------------------------- BinSGDM's fused worker math
@pytest.mark.parametrize("eps", [1e-8, 0.0])
@pytest.mark.parametrize("beta", [0.9, 0.5])
def test_vote_threshold_is_bitwise_the_torch_operations(monkeypatch, eps, beta):
    from hf_onebit.optim.binsgdm import vote_threshold_

    gen = torch.Generator().manual_seed(0)
    n = 100_003
    def wide(): return torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 3, (n,), generator=gen).float()
    m, g = wide(), wide()
    b = m.abs() * torch.rand(n, generator=gen) * 3
    m[:10], b[:10], g[:5] = 0.0, 0.0, 0.0  # 0/0 with eps == 0: z = 0
    g[20], g[21], m[22], b[23], g[24] = float("inf"), float("nan"), float("nan"), float("inf"), float("-inf")
    monkeypatch.setenv("HF_ONEBIT_KERNELS", "reference")  # the torch operations
    want = [torch.empty(n) for _ in range(3)]
    vote_threshold_(m, b, g, beta=beta, eps=eps, m_out=want[0], b_out=want[1], theta=want[2], tmp=torch.empty(n))
    got = [torch.empty(n) for _ in range(3)]
    cpu.vote_threshold(m, b, g, beta=beta, eps=eps, m_out=got[0], b_out=got[1], theta=got[2])
    for name, a, w in zip(("m_out", "b_out", "theta"), got, want):
        assert torch.equal(a.view(torch.int32), w.view(torch.int32)), name  # bit patterns, NaNs included
    assert torch.isinf(got[1]).any() and torch.isnan(got[0]).any()  # the special values reached the outputs
    assert bool(torch.isnan(got[2]).any()) == (eps != 0)  # with eps == 0 a NaN z is 0 (0/0 of unseen coordinates)
    monkeypatch.delenv("HF_ONEBIT_KERNELS")
    fused = [torch.empty(n) for _ in range(3)]  # BinSGDM's own call takes the fused pass on CPU
    vote_threshold_(m, b, g, beta=beta, eps=eps, m_out=fused[0], b_out=fused[1], theta=fused[2], tmp=torch.empty(n))
    assert all(torch.equal(a.view(torch.int32), w.view(torch.int32)) for a, w in zip(fused, want))


def test_vote_threshold_refuses_what_it_cannot_write():
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.vote_threshold(x, x, x, beta=0.9, eps=1e-8, m_out=torch.zeros(8, 2)[:, 0], b_out=x.clone(), theta=x.clone())
    with pytest.raises(ValueError, match="lengths differ"):
        cpu.vote_threshold(x, x, x, beta=0.9, eps=1e-8, m_out=torch.zeros(7), b_out=x.clone(), theta=x.clone())


def test_pack_bools_matches_the_reference_layout():
    """BinSGDM's vote packing: numpy's packbits (CPU) and the torch reference (every other device)
    write the same bytes, in the layout of ``pack_signs`` (MSB first, True = +1)."""
    votes = torch.rand(8 * 37, generator=torch.Generator().manual_seed(1)) < 0.3
    a = torch.empty(37, dtype=torch.uint8)
    b = torch.empty(37, dtype=torch.uint8)
    cpu.pack_bools(votes, a)
    ref.pack_bools(votes, b)
    assert torch.equal(a, b)
    assert torch.equal(ref.unpack_signs(a), torch.where(votes, 1.0, -1.0))
    for backend in (cpu, ref):
        with pytest.raises(ValueError, match="multiple of 8"):
            backend.pack_bools(votes[:9], torch.empty(1, dtype=torch.uint8))


# ---------------------------------------------------------------- numba's cache of the loop files
def test_every_loop_file_that_inlines_cpu_jit_names_its_digest():
    """numba keys a cached loop on its own file alone: a file that calls cpu_jit's loops must
    refuse to import against another cpu_jit, so that editing cpu_jit forces an edit there."""
    import pathlib
    import re

    from hf_onebit.kernels import cpu_jit

    users = [p for p in pathlib.Path(cpu_jit.__file__).parent.glob("*.py")
             if "from .cpu_jit import" in p.read_text() and "@njit" in p.read_text()]  # loops, not host code
    assert {p.name for p in users} >= {"cpu_sign_loops.py", "cpu_code_loops.py"}
    for path in users:
        named = re.findall(r'require_digest\("([0-9a-f]+)", "([\w.]+)"\)', path.read_text())
        assert [name for _, name in named] == [path.name], path.name
        cpu_jit.require_digest(named[0][0], path.name)  # the current digest: no error
    with pytest.raises(ImportError, match="set the digest that cpu_code_loops.py passes to require_digest to '[0-9a-f]{16}'"):
        cpu_jit.require_digest("0" * 16, "cpu_code_loops.py")


# ---------------------------------------------------------------- piece layouts checked once
def test_a_bounds_layout_is_checked_once_and_a_plain_sequence_every_call(monkeypatch):
    """The exchange passes a contract.Bounds per segment: its bounds are checked and converted
    once (with 32-element pieces that cost more than the kernels); a plain list at every call."""
    from hf_onebit.kernels.contract import Bounds

    checked = []
    real = cpu.check_bounds
    monkeypatch.setattr(cpu, "check_bounds", lambda b, n: checked.append(n) or real(b, n))
    x, error = torch.randn(256), torch.zeros(256)
    layout, plain = Bounds(range(0, 257, 32)), list(range(0, 257, 32))
    for _ in range(3):
        got = cpu.qworker_scale(x, error, width=8, bounds=layout)
    assert checked == [256] and torch.equal(got, ref.qworker_scale(x, error, width=8, bounds=plain))
    for _ in range(2):
        cpu.qworker_scale(x, error, width=8, bounds=plain)
    assert checked == [256] * 3
    with pytest.raises(ValueError, match="multiple of 8"):  # a bad layout is refused at its first use
        cpu.qworker_scale(x, error, width=8, bounds=Bounds([0, 4, 256]))
