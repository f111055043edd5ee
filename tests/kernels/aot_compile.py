"""Compile every Triton kernel of hf_onebit ahead of time for real GPU targets, on a machine without one.

    python tests/kernels/aot_compile.py 80 90      # prints one line per kernel and target; exit 1 on a failure

The kernels are launched exactly as :func:`hf_onebit.kernels.selftest.self_test` launches them
(every wrapper, 1-bit and b-bit at both widths, fp32/bf16/fp16 inputs, one scale per chunk and
pieces), with the launch caught
before it reaches a driver: each caught launch gives the kernel, its argument types, its
``constexpr`` values and its launch options, which are compiled with ``triton.compile`` for
``GPUTarget("cuda", sm, 32)`` down to a cubin (PTX, then the ptxas Triton ships). Run without
``TRITON_INTERPRET`` (the interpreter replaces the JIT functions). What this proves: the kernels
type-check, lower and assemble for sm_80 and sm_90; not that they run correctly there (that
needs a GPU: ``hf-onebit check``), and that no kernel divides approximately (``div.full.f32``:
Triton's ``/`` on NVIDIA), which would change bits against the reference.
"""

from __future__ import annotations

import os
import sys

assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET: it replaces the JIT functions"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
         torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def caught_launches() -> dict:
    """(kernel name, signature, constexprs, options) -> (kernel, signature, constexprs, options)."""
    from hf_onebit.kernels import selftest
    from hf_onebit.kernels import triton as backend

    launches = {}

    def catch(self, *args, grid, warmup, **kwargs):
        params = self.params
        values = dict(zip([p.name for p in params], args))
        values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
        signature, constexprs = {}, {}
        for p in params:
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constexprs[p.name] = values[p.name]
            else:
                signature[p.name] = _type(values[p.name])
        options = {k: v for k, v in kwargs.items() if k in OPTIONS}
        key = (self.__name__, tuple(signature.items()), tuple(constexprs.items()), tuple(options.items()))
        launches[key] = (self, signature, constexprs, options)

    real = JITFunction.run
    JITFunction.run = catch
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for bounds in (None, "pieces"):
                selftest._everything(backend, torch.device("cpu"), dtype, bounds)  # 1-bit and b-bit
    finally:
        JITFunction.run = real
    return launches


def main(archs: list[int]) -> int:
    launches = caught_launches()
    failed = 0
    kernels = sorted({k[0] for k in launches})
    for cc in archs:
        for key, (fn, signature, constexprs, options) in sorted(launches.items(), key=lambda kv: str(kv[0])):
            try:
                compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                          target=GPUTarget("cuda", cc, 32), options=options)
                size = len(compiled.asm["cubin"])
                approximate = [op for op in ("div.full.f32", "div.approx.f32") if op in compiled.asm["ptx"]]
                if approximate:  # the reference divides in IEEE: an approximate division changes bits
                    raise ValueError(f"approximate division in the PTX: {approximate}")
                print(f"sm_{cc} ok    {fn.__name__} {dict(constexprs)} {options}: cubin {size} bytes")
            except Exception as exc:  # noqa: BLE001 - reported, counted
                failed += 1
                print(f"sm_{cc} FAIL  {fn.__name__} {dict(constexprs)} {options}: {type(exc).__name__}: {exc}")
    print(f"{len(kernels)} kernels, {len(launches)} specialisations, {len(archs)} targets, {failed} failed"
          f" (triton {triton.__version__})")
    return 1 if failed or not launches else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [80, 90]))
