"""The world sizes and node layouts at which every optimizer's trajectory is checked against its
simulation (``tests/simulation.py`` and the simulations in the optimizer test modules).

The algorithms change with the number of ranks ``n``: the exchange pads each buffer to a
multiple of ``8·n`` and cuts it into ``n`` chunks, each with a server error of its own; BinSGDM
averages ``n`` votes (``M`` node votes by node). By node (``M`` nodes of ``k`` ranks, emulated on
this machine by ``LOCAL_WORLD_SIZE=k``), the buffer is cut into ``k`` shards, each exchanged
among the ``M`` node means. ``n`` = 3 and the 6-rank layouts are not powers of two (the padding
and the chunks then fall elsewhere than for 2, 4, 8, 16); ``k`` = 3 gives shards of odd sizes.

Starting a rank costs seconds of CPU (a fresh Python imports torch and hf_onebit), and the ranks
of each world size are kept in a pool for the whole session (``tests/distributed.py``): 2, 3 and
4 ranks are started by the default tests anyway, while 6, 8 and 16 ranks (30 more processes) run
under ``-m slow``.
"""

from __future__ import annotations

import pytest

_slow = pytest.mark.slow

#: world sizes of the flat (one-level) trajectory tests
WORLD_SIZES = [2, 3, 4, pytest.param(8, marks=_slow), pytest.param(16, marks=_slow)]

#: ``(nodes, ranks per node)`` of the by-node trajectory tests
NODE_LAYOUTS = [
    pytest.param(2, 2, id="2x2"),
    *(pytest.param(M, k, id=f"{M}x{k}", marks=_slow) for M, k in [(2, 4), (4, 2), (3, 2), (2, 3)]),
]


def node_env(local_size: int) -> dict:
    """The environment that makes ``run_distributed``'s ranks nodes of ``local_size`` ranks."""
    return {"LOCAL_WORLD_SIZE": str(local_size)}
