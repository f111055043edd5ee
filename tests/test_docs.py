"""Every python/bash block in README.md, docs/integrations.md and docs/getting-started.md runs as printed.

Each fenced ``python`` or ``bash`` block is preceded by a marker line saying what the test does
with it (blocks without a language are printed outputs and are not run):

``<!-- doctest: run -->``
    run the block (bash: ``bash -e``; python: as a script), in the page's work directory; it must
    exit with 0. ``fails="TEXT"``: it must fail, with TEXT in its output.
``<!-- doctest: file NAME -->``
    write the block to NAME in the work directory (a later block runs it).
``<!-- doctest: skip REASON -->``
    not run, and the reason says why (an install, a download, a multi-GPU machine ...).

Options of ``run``: ``fresh``: the block runs in a new empty directory outside the checkout (what a
user of the installed package has); ``copy=PATH``: copy that repository file into the directory
first. Every page's work directory starts with ``recipes`` linked to the repository's, so the
commands written "from the repository root" run as printed. The environment is a user's: no
``ACCELERATE_USE_CPU``, no launcher variables, offline Hub, ``PYTHONPATH`` = this checkout.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import sys
from pathlib import Path

import pytest

from tests.integrations.launch import REPO, base_env, run

PAGES = ["README.md", "docs/integrations.md", "docs/getting-started.md"]
MARKER = re.compile(r"^<!--\s*doctest:\s*(run|file|skip)\b(.*?)-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")


def blocks(page: str) -> list[dict]:
    """The fenced python/bash blocks of ``page`` with their markers (line numbers for messages)."""
    lines = (REPO / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if lang in ("python", "bash"):
            prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(prev.strip())
            out.append({"page": page, "line": start + 1, "lang": lang, "code": "\n".join(lines[start + 1:end]) + "\n",
                        "action": marker.group(1) if marker else None, "args": marker.group(2).strip() if marker else ""})
        i = end + 1
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_marked_and_every_skip_says_why(page):
    found = blocks(page)
    assert found, f"{page}: no python/bash blocks found"
    unmarked = [b["line"] for b in found if b["action"] is None]
    assert not unmarked, f"{page}: blocks without a <!-- doctest: ... --> marker at lines {unmarked}"
    for b in found:
        if b["action"] == "skip":
            assert len(b["args"]) > 10, f"{page}:{b['line']}: a skipped block must say why"
        if b["action"] == "file":
            assert re.fullmatch(r"[\w.-]+", b["args"]), f"{page}:{b['line']}: file needs a NAME"
    assert any(b["action"] == "run" for b in found), f"{page}: nothing is run"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = base_env(cpu=False)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's --master-port default (29500 may be taken)
    env.pop("CI", None)
    return env


def _workdir(base: Path, name: str) -> Path:
    work = base / name
    work.mkdir()
    return work


def run_page(page: str, tmp_path: Path, timeout: float = 300) -> list[str]:
    """Run the page's blocks in order; returns one line per block run."""
    work = _workdir(tmp_path, "page")
    (work / "recipes").symlink_to(REPO / "recipes")
    done = []
    for n, b in enumerate(blocks(page)):
        where = f"{page}:{b['line']}"
        if b["action"] == "skip":
            continue
        if b["action"] == "file":
            (work / b["args"]).write_text(b["code"])
            continue
        opts = shlex.split(b["args"])
        cwd = _workdir(tmp_path, f"fresh{n}") if "fresh" in opts else work
        for opt in opts:
            if opt.startswith("copy="):
                shutil.copy(REPO / opt[5:], cwd / Path(opt[5:]).name)
        if b["lang"] == "bash":
            cmd = ["bash", "-e", "-o", "pipefail", "-c", b["code"]]
        else:
            script = cwd / f"block_{n}.py"
            script.write_text(b["code"])
            cmd = [sys.executable, str(script)]
        env = _env()
        env["PET_MASTER_PORT"] = str(_free_port())
        res = run(cmd, env=env, cwd=cwd, timeout=timeout)
        fails = next((o[len("fails="):] for o in opts if o.startswith("fails=")), None)
        if fails is None:
            assert res.returncode == 0, f"{where}: exit code {res.returncode}\n{b['code']}\n{res.output[-5000:]}"
        else:
            assert res.returncode != 0, f"{where}: expected to fail\n{res.output[-3000:]}"
            assert fails in res.output, f"{where}: {fails!r} not in the output\n{res.output[-3000:]}"
        done.append(f"{where}: ok")
    return done


def test_readme_blocks_run(tmp_path):
    assert run_page("README.md", tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", ["docs/getting-started.md", "docs/integrations.md"])
def test_doc_blocks_run(tmp_path, page):
    assert run_page(page, tmp_path)
