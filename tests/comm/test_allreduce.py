"""Full-precision helpers of ``hf_onebit.comm.allreduce``."""

from __future__ import annotations

import pytest
import torch

from hf_onebit.comm.allreduce import finite_flag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_flag_sees_every_non_finite_value(dtype):
    x = torch.linspace(-3, 3, 1000, dtype=dtype).reshape(10, 100).t()  # non-contiguous
    assert finite_flag(x).dtype == torch.bool and finite_flag(x).dim() == 0
    assert bool(finite_flag(x))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 517, 999):
            y = x.clone()
            y[where % 100, where // 100] = bad
            assert not bool(finite_flag(y)), (bad, where)
    assert bool(finite_flag(torch.empty(0, 4, dtype=dtype)))  # nothing to be non-finite
