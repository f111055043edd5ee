"""Compile every Triton kernel of hf_onebit ahead of time for real GPU targets, on a machine without one.

    python tests/kernels/aot_compile.py 80 90                  # the self-test's launches
    python tests/kernels/aot_compile.py --list training 80 90  # what training launches besides
    python tests/kernels/aot_compile.py --list all --jobs 4 80 90

One line per kernel and target; exit 1 on a failure. The compiles run in ``--jobs`` processes
(default: one per CPU core). Two compile lists:

* ``selftest``: the kernels launched exactly as :func:`hf_onebit.kernels.selftest.self_test`
  launches them (every wrapper, 1-bit and b-bit at both widths, fp32/bf16/fp16 inputs, one scale
  per chunk and pieces): 2 ranks, rank 0, small buffers;
* ``training``: what training launches that the self-test does not. The launches of
  :class:`hf_onebit.comm.compressed.CompressedAllReduce`, the one caller of the kernels in
  training, made by its own code on a pretended world (its collectives replaced by no-ops; every
  kernel launch is caught, so their output does not matter): a baseline (8 ranks, rank 3, a
  bucket of 4096 elements, one scale per chunk and per tensor piece, 1-bit and 8- and 4-bit
  codes, fp32/bf16/fp16 buckets) and the baseline with one thing changed at a time
  (:data:`VARIATIONS`: 2 and 64 ranks, so ``N_PAD`` 2 and 64, a world of 1 launching nothing;
  rank 0 and rank 1, which Triton makes a constant; a size that is no multiple of 16; a bucket
  that starts off a 16-byte boundary), and the fp32 baseline again with its element counts as
  64-bit integers, as Triton types them from 2^31 elements on (a buffer too large to build here).
  BinSGDM's two kernels, called by its bucket layouts (:class:`hf_onebit.optim.vote_core.VoteLayout`)
  as training calls them: ``vote_threshold`` on a bucket divisible by 16, on one that is not, on a
  span that starts off a 16-byte boundary and with 64-bit sizes; ``vote_uniform`` for a bucket of
  one tensor and of several, with seeds, streams and steps whose 22-bit chunks are 0, 1 and
  neither (its integer arguments are not specialised, so these are the self-test's variant).

Each caught launch gives the kernel, its argument types, its ``constexpr`` values, its launch
options and the specialisations Triton's launcher would add (an int argument equal to 1 becomes
a constant, an int divisible by 16 or a 16-byte-aligned pointer gets ``tt.divisibility=16``), read
with Triton's own rules (``native_specialize_impl``); they are compiled with ``triton.compile``
for ``GPUTarget("cuda", sm, 32)`` down to a cubin (PTX, then the ptxas Triton ships). Run without
``TRITON_INTERPRET`` (the interpreter replaces the JIT functions). What this proves: the kernels
type-check, lower and assemble for sm_80 and sm_90 in the variants that will be compiled at run
time; not that they run correctly there (that needs a GPU: ``hf-onebit check``), and that no
kernel divides approximately (``div.full.f32``: Triton's ``/`` on NVIDIA), which would change
bits against the reference.
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


try:  # Triton's launcher's own rules (triton >= 3.4); see _specialise
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
except ImportError:  # pragma: no cover - an older Triton: types only, no hints
    native_specialize_impl = None


def _specialise(param, value) -> tuple[str, object, list]:
    """``(type, constant or None, attributes)`` of one argument, as Triton's launcher sees it: an
    int equal to 1 becomes a constant, an int divisible by 16 or a 16-byte-aligned pointer gets
    ``tt.divisibility=16`` (unless the kernel opts out of that argument's specialisation)."""
    if native_specialize_impl is None or isinstance(value, float):
        return _type(value), None, []
    kind, key = native_specialize_impl(BaseBackend, value, param.is_const, not param.do_not_specialize,
                                       not param.do_not_specialize_on_alignment)[:2]
    if kind == "constexpr":
        return kind, key, []
    return kind, None, (BaseBackend.parse_attr(key) if isinstance(key, str) else [])


#: the element counts among the kernels' int arguments (the rest count ranks and pieces)
SIZE_ARGS = ("N", "L", "numel", "row_bytes", "count")


def _catcher(launches: dict):
    """A replacement for ``JITFunction.run`` that records each launch in ``launches`` (with the
    argument values, for :func:`_as_i64`) and runs nothing."""

    def catch(self, *args, grid, warmup, **kwargs):
        params = self.params
        values = dict(zip([p.name for p in params], args))
        values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
        options = {k: v for k, v in kwargs.items() if k in OPTIONS}
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(params):
            value = values[p.name]
            if p.is_constexpr:
                signature[p.name], constexprs[p.name] = "constexpr", value
                continue
            kind, constant, hints = _specialise(p, value)
            signature[p.name] = kind
            if kind == "constexpr":
                constexprs[p.name] = constant
            elif hints:
                attrs[(i,)] = hints
        launches[_key(self, signature, constexprs, attrs, options)] = (self, signature, constexprs, attrs, options)

    return catch


def _key(fn, signature, constexprs, attrs, options) -> tuple:
    return (fn.__name__, tuple(signature.items()), tuple(constexprs.items()),
            tuple(sorted((k, str(v)) for k, v in attrs.items())), tuple(options.items()))


def _as_i64(fn, signature, constexprs, attrs, options) -> tuple:
    """The launch with every element count (:data:`SIZE_ARGS`) as Triton types it from 2^31 on:
    i64, no hint (a size of 1 made constant becomes an argument again)."""
    signature = {k: ("i64" if k in SIZE_ARGS else v) for k, v in signature.items()}
    constexprs = {k: v for k, v in constexprs.items() if k not in SIZE_ARGS}
    attrs = {k: v for k, v in attrs.items() if fn.params[k[0]].name not in SIZE_ARGS}
    return fn, signature, constexprs, attrs, options


def _selftest_launches(launches: dict, i64: list) -> None:
    from hf_onebit.kernels import selftest
    from hf_onebit.kernels import triton as backend

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for bounds in (None, "pieces"):
            selftest._everything(backend, torch.device("cpu"), dtype, bounds)  # 1-bit and b-bit


class _PretendedWorld:
    """``torch.distributed`` as :mod:`hf_onebit.comm.compressed` sees it, for ``n`` ranks of
    which this is ``rank``: collectives do nothing (their buffers keep what they held)."""

    def __init__(self, n: int, rank: int) -> None:
        self.n, self.rank = n, rank

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group=None) -> int:
        return self.n

    def get_rank(self, group=None) -> int:
        return self.rank

    def all_to_all_single(self, *args, **kwargs) -> None:
        return None


#: the training launches compiled: a baseline, the most common case (8 ranks, a rank other than
#: 0 and 1, a bucket of a size divisible by 16 at the start of its storage, one scale per chunk
#: and per tensor piece, each width and bucket dtype), then the baseline with one thing changed
#: at a time. Each combination is a distinct program to Triton, but a kernel that compiles in
#: each variant of each axis is what matters; the full product (771 specialisations, 20 minutes
#: of compiling here) would add little beyond the axes' interactions.
BASELINE = dict(n=8, rank=3, numel=4096, offset=0)
VARIATIONS = (
    dict(n=2, rank=1),  # the smallest world: N_PAD 2
    dict(n=64),  # N_PAD 64, n divisible by 16
    dict(rank=0),  # an int divisible by 16: tt.divisibility on rank
    dict(rank=1),  # an int equal to 1: a constant
    dict(numel=3001),  # sizes that are not multiples of 16
    dict(offset=1),  # a bucket one float past a 16-byte boundary: no alignment hint on x
)
#: per-tensor piece sizes of each bucket size (the library's default, one scale per tensor)
PIECES = {4096: (1000, 24, 3072), 3001: (2000, 3, 998)}


def _training_launches(launches: dict, i64: list) -> None:
    """Fill ``launches`` with the baseline and its variations; ``i64`` collects the baseline's keys
    (they get 64-bit twins: see :func:`caught_launches`)."""
    from hf_onebit.comm import compressed
    from hf_onebit.kernels import triton as backend

    real_dist, real_gather = compressed.dist, compressed.all_gather_into_tensor
    try:
        compressed.all_gather_into_tensor = lambda *args, **kwargs: None
        for variation in ({}, *VARIATIONS):
            case = {**BASELINE, **variation}
            compressed.dist = _PretendedWorld(case["n"], case["rank"])
            # the variations in fp32 and bf16 buckets (an fp16 bucket means a model in fp16: rare)
            dtypes = (torch.float32, torch.bfloat16) if variation else (torch.float32, torch.bfloat16, torch.float16)
            for pieces in (None, PIECES[case["numel"]]):
                for dtype in dtypes:
                    before = set(launches)
                    for width in (1, 8, 4):
                        allreduce = compressed.CompressedAllReduce(case["numel"], "cpu", kernels=backend,
                                                                   piece_sizes=pieces)
                        offset = case["offset"]
                        allreduce(torch.zeros(case["numel"] + offset, dtype=dtype)[offset:], width=width)
                    if not variation and dtype is torch.float32:
                        # 64-bit twins of the fp32 baseline: the kernels meet 2^31 elements only in
                        # a bucket or shard of 8 GiB; the other dtypes' twins would add compile
                        # time and little else
                        i64.extend(set(launches) - before)
    finally:
        compressed.dist, compressed.all_gather_into_tensor = real_dist, real_gather


def _vote_launches(launches: dict, i64: list) -> None:
    """BinSGDM's kernels as its layouts launch them (see the module docstring)."""
    from hf_onebit.kernels import triton as backend

    for numel, offset in ((4096, 0), (3001, 0), (4096, 1)):  # a whole bucket; not /16; a span off 16 bytes
        m, b, g, m_out, b_out, theta = (torch.zeros(numel + offset)[offset:] for _ in range(6))
        before = set(launches)
        backend.vote_threshold(m, b, g, beta=0.9, eps=1e-8, m_out=m_out, b_out=b_out, theta=theta)
        if (numel, offset) == (4096, 0):
            i64.extend(set(launches) - before)
    for offsets in ([0, 4096], [0, 1000, 1024, 4096]):  # one tensor (pieces = 1), several
        table = backend.vote_uniform_table(offsets, list(range(len(offsets) - 1)), "cpu")
        # seed 0 and step 1 (every chunk 0 or 1), rank 1's stream; then chunks neither 0 nor 1
        for seed, stream, step in ((0, 1, 1), (2**63 + 12345, 3, 10**6)):
            backend.vote_uniform(torch.empty(4096), table, seed=seed, stream=stream, step=step)


def _training_and_vote_launches(launches: dict, i64: list) -> None:
    _training_launches(launches, i64)
    _vote_launches(launches, i64)


#: name -> what fills the launches
LISTS = {"selftest": _selftest_launches, "training": _training_and_vote_launches}


def caught_launches(which: str = "selftest") -> dict:
    """(kernel name, signature, constexprs, attrs, options) -> (kernel, signature, constexprs,
    attrs, options) for the list ``which``: ``selftest``, ``training`` (what training launches
    that the self-test does not: the second compile list) or ``all``."""
    if which == "all":
        return {**caught_launches("selftest"), **caught_launches("training")}
    launches: dict = {}
    i64: list = []
    real = JITFunction.run
    JITFunction.run = _catcher(launches)
    try:
        LISTS[which](launches, i64)
    finally:
        JITFunction.run = real
    for key in i64:
        twin = _as_i64(*launches[key])
        launches[_key(*twin)] = twin
    if which == "training":
        for key in caught_launches("selftest"):
            launches.pop(key, None)
    return launches


def _compile_share(which: str, archs: list[int], share: int, shares: int) -> tuple[list[str], int]:
    """Compile every ``shares``-th launch of the list from the ``share``-th on, for each target:
    ``(lines, failures)``. Each worker process catches the launches itself (a few seconds):
    Triton's JIT functions do not travel between processes."""
    launches = sorted(caught_launches(which).items(), key=lambda kv: str(kv[0]))[share::shares]
    lines, failed = [], 0
    for cc in archs:
        for _, (fn, signature, constexprs, attrs, options) in launches:
            i64 = [k for k, v in signature.items() if v == "i64"]
            hinted = [fn.params[i[0]].name for i in attrs]
            what = f"{fn.__name__} {dict(constexprs)} {options} i64={i64} divisible={hinted}"
            try:
                compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                          target=GPUTarget("cuda", cc, 32), options=options)
                size = len(compiled.asm["cubin"])
                approximate = [op for op in ("div.full.f32", "div.approx.f32") if op in compiled.asm["ptx"]]
                if approximate:  # the reference divides in IEEE: an approximate division changes bits
                    raise ValueError(f"approximate division in the PTX: {approximate}")
                lines.append(f"sm_{cc} ok    {what}: cubin {size} bytes")
            except Exception as exc:  # noqa: BLE001 - reported, counted
                failed += 1
                lines.append(f"sm_{cc} FAIL  {what}: {type(exc).__name__}: {exc}")
    return lines, failed


def main(archs: list[int], which: str = "selftest", jobs: int | None = None) -> int:
    """Compile list ``which`` for ``archs`` in ``jobs`` processes (default: one per CPU core)."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    start = time.monotonic()
    launches = caught_launches(which)
    caught = time.monotonic() - start
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(launches) or 1))
    if jobs == 1:
        results = [_compile_share(which, archs, 0, 1)]
    else:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_compile_share, *zip(*[(which, archs, i, jobs) for i in range(jobs)])))
    failed = sum(f for _, f in results)
    for lines, _ in results:
        print("\n".join(lines))
    kernels = sorted({k[0] for k in launches})
    print(f"{len(kernels)} kernels, {len(launches)} specialisations ({which}), {len(archs)} targets, {failed} failed"
          f" (triton {triton.__version__}; caught in {caught:.1f} s, compiled in {time.monotonic() - start - caught:.0f} s"
          f" by {jobs} processes)")
    return 1 if failed or not launches else 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    which, jobs = "selftest", None
    while argv[:1] and argv[0].startswith("--"):
        if argv[0] == "--list" and len(argv) > 1 and argv[1] in (*LISTS, "all"):
            which, argv = argv[1], argv[2:]
        elif argv[0] == "--jobs" and len(argv) > 1 and argv[1].isdigit() and int(argv[1]) > 0:
            jobs, argv = int(argv[1]), argv[2:]
        else:
            sys.exit(f"usage: aot_compile.py [--list {'|'.join((*LISTS, 'all'))}] [--jobs N] [sm ...]; got {argv[0]!r}")
    sys.exit(main([int(a) for a in argv] or [80, 90], which, jobs))
