"""Optional test dependencies: skipped on a developer's machine, required in CI.

A test that skips because a package is missing proves nothing, so under ``CI=true`` (set by
``.ci/run``'s caller) a missing package is an error that names the install command.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def require(module: str, why: str, *, skip: bool = True) -> bool:
    """True when ``module`` can be imported; otherwise fail under CI, else skip (or return False)."""
    if importlib.util.find_spec(module) is not None:
        return True
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise RuntimeError(f"CI needs {module!r}: {why}")
    if skip:
        pytest.skip(why, allow_module_level=True)
    return False
