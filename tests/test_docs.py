"""The user docs (README.md, docs/*.md): their blocks run as printed, their outputs match, their
links resolve, the commands and tests they name exist, and their figures agree with each other
and with the stored benchmark results.

Each fenced ``python`` or ``bash`` block is preceded by a marker line saying what the test does
with it:

``<!-- doctest: run -->``
    run the block (bash: ``bash -e``; python: as a script), in the page's work directory; it must
    exit with 0. ``fails="TEXT"``: it must fail, with TEXT in its output.
``<!-- doctest: file NAME -->``
    write the block to NAME in the work directory (a later block runs it).
``<!-- doctest: skip REASON -->``
    not run, and the reason says why (an install, a download, a multi-GPU machine ...).

A fence without a language is a printed output. Marked ``<!-- doctest: output -->``, it is the
expected output of the run block before it: each of its non-empty lines must occur in the
command's output, in order (a line of the output contains it), where ``...`` stands for any text.
Unmarked outputs are not compared (timings, abridged logs).

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
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.launch import REPO, base_env, run

#: every page of the user docs
DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
#: the pages whose blocks run (README.md in the fast suite, the others in the slow one)
PAGES = ["README.md", "docs/getting-started.md", "docs/integrations.md", "docs/troubleshooting.md", "docs/api.md",
         "docs/cost-model.md", "docs/deepspeed.md", "docs/multi-node.md"]
MARKER = re.compile(r"^<!--\s*doctest:\s*(run|file|skip|output)\b(.*?)-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
#: the line budget of the user docs, and of the results page
MAX_LINES, MAX_RESULTS_LINES = 1500, 150


def _marker_before(lines: list[str], start: int):
    prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
    return MARKER.match(prev.strip())


def blocks(page: str) -> list[dict]:
    """The fenced python/bash blocks of ``page`` with their markers (line numbers for messages);
    a marked output block becomes the ``expect`` of the block before it."""
    lines = (REPO / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = _marker_before(lines, start)
        if lang in ("python", "bash"):
            out.append({"page": page, "line": start + 1, "lang": lang, "code": "\n".join(lines[start + 1:end]) + "\n",
                        "action": marker.group(1) if marker else None, "args": marker.group(2).strip() if marker else "",
                        "expect": None})
        elif not lang and marker and marker.group(1) == "output":
            assert out and out[-1]["action"] == "run", f"{page}:{start + 1}: an output block must follow a run block"
            out[-1]["expect"] = [ln for ln in lines[start + 1:end] if ln.strip()]
        i = end + 1
    return out


def check_output(expect: list[str], output: str, where: str) -> None:
    """Each expected line occurs in ``output``, in order; ``...`` in it stands for any text."""
    got = output.splitlines()
    pos = 0
    for want in expect:
        pattern = re.compile(".*".join(re.escape(part.strip()) for part in want.split("...")))
        hit = next((k for k in range(pos, len(got)) if pattern.search(got[k])), None)
        assert hit is not None, f"{where}: expected output line not found (in order): {want!r}\n--- output:\n{output[-4000:]}"
        pos = hit + 1


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


def test_pages_without_run_blocks_have_no_unmarked_code():
    for page in set(DOCS) - set(PAGES):
        marked = [b for b in blocks(page) if b["action"] not in ("skip", None)]
        assert not marked, f"{page} has blocks marked to run: add it to PAGES"


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
        if b["expect"]:
            check_output(b["expect"], res.output, where)
        done.append(f"{where}: ok")
    return done


def test_readme_blocks_run(tmp_path):
    assert run_page("README.md", tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", [p for p in PAGES if p != "README.md"])
def test_doc_blocks_run(tmp_path, page):
    assert run_page(page, tmp_path)


# --------------------------------------------------------------------------- pages, links, names
def _text(page: str) -> str:
    return (REPO / page).read_text()


def _prose(page: str) -> str:
    """The page without its fenced blocks (printed outputs may hold anything)."""
    return re.sub(r"^```.*?^```", "", _text(page), flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return s.replace(" ", "-")


def anchors(page: str) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", _prose(page), flags=re.M)}


def test_the_user_docs_fit_their_budget():
    sizes = {page: len(_text(page).splitlines()) for page in DOCS}
    assert sum(sizes.values()) <= MAX_LINES, f"user docs: {sum(sizes.values())} lines > {MAX_LINES}: {sizes}"
    assert sizes["docs/results.md"] <= MAX_RESULTS_LINES, f"docs/results.md: {sizes['docs/results.md']} lines"


def test_links_resolve():
    bad = []
    for page in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            dest = (REPO / page).parent / path if path else REPO / page
            if not dest.exists():
                bad.append(f"{page}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(str(dest.resolve().relative_to(REPO))):
                bad.append(f"{page}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


#: what a user guide does not hold: dates, commit hashes, issue numbers, session words, local folders
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b|\bissues? \d+|"
                     r"\bthis session\b|\btoday\b|\bprevious session\b|\boutputs/", re.I)


def test_no_history_in_the_docs():
    found = [f"{page}: {m.group(0)!r}" for page in DOCS for m in HISTORY.finditer(_text(page))]
    assert not found, "\n".join(found)


def test_named_scripts_and_tests_exist():
    missing = []
    for page in DOCS:
        text = _text(page)
        for path in set(re.findall(r"(?<![\w/.<>{}-])((?:recipes|benchmarks|tests|hf_onebit)/[\w./-]*\w)", text)):
            if "*" in path or re.search(r"/[A-Z]+\.", path):  # a pattern, a placeholder (NAME.yaml)
                continue
            if not (REPO / path).exists() and not any(REPO.glob(path + "*")):
                missing.append(f"{page}: {path}")
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", text):
            source = (REPO / path).read_text() if (REPO / path).exists() else ""
            if f"def {name}" not in source:
                missing.append(f"{page}: {path}::{name}")
    assert not missing, "\n".join(missing)


def _table_rows(text: str, header_start: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def test_the_failure_table_counts_its_cases():
    text = _text("docs/troubleshooting.md")
    rows = _table_rows(text, "| case | behaviour | test |")
    said = int(re.search(r"^(\d+) cases, each with its test", text, flags=re.M).group(1))
    assert said == len(rows), f"troubleshooting.md says {said} cases, its table has {len(rows)} rows"
    assert all(row[2] for row in rows), "every case names its test"


def _numbers(cell: str) -> list[str]:
    return re.findall(r"[−+-]?\d+(?:[.,]\d+)*", cell)


def test_the_speed_table_is_the_stored_benchmark():
    """results.md's network table and the which-optimizer table's speeds reprint the stored runs
    (docs/img/defaults/network_40.json)."""
    report = subprocess.run([sys.executable, "benchmarks/network.py", "--report-from", "docs/img/defaults/network_40.json"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    figures = set(re.findall(r"\d+\.\d+", report.stdout))
    for row in _table_rows(_text("docs/results.md"), "| method | 200 Mbit/s"):
        for cell in row[1:]:
            for number in _numbers(cell):
                assert number in figures, f"results.md speed table: {row[0]} {number} not in the report"
    for row in _table_rows(_text("docs/getting-started.md"), "| `--optim` |"):
        for cell in row[4:6]:
            assert cell.rstrip("x") in figures, f"getting-started.md: {row[0]} speed {cell} not in the report"


def test_the_time_to_accuracy_table_is_the_stored_run():
    """results.md's time-to-accuracy table reprints docs/img/time_to_accuracy/tta_200mbit.json."""
    report = subprocess.run([sys.executable, "benchmarks/time_to_accuracy.py", "--report-from",
                             "docs/img/time_to_accuracy/tta_200mbit.json"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    rows = _table_rows(_text("docs/results.md"), "| method | whole run (x AdamW)")
    assert len(rows) == 5
    for row in rows:
        printed = next(ln for ln in report.stdout.splitlines() if ln.startswith(f"| {row[0]}"))
        for cell in row[1:]:
            for number in _numbers(cell):
                assert number in printed, f"results.md time to accuracy: {row[0]} {number} not in the report"


def _summarized(runs: list) -> str:
    """What ``convergence.py --summarize`` prints for the stored runs."""
    report = subprocess.run([sys.executable, "benchmarks/convergence.py", "--summarize", *runs],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    return report.stdout


def test_the_plain_pytorch_table_is_the_stored_runs():
    """results.md's plain-PyTorch accuracy table reprints ``convergence.py --summarize`` of the
    stored runs (docs/img/plain/<task>_<freeze>_s<seed>.json), column by column."""
    rows = _table_rows(_text("docs/results.md"), "| method | Rotten Tomatoes, automatic freeze")
    assert [r[0] for r in rows] == ["1-bit Adam", "0/1 Adam", "1-bit LAMB", "BinSGDM"]
    columns = [("rotten_tomatoes", "auto"), ("rotten_tomatoes", "20"), ("tweets", "auto"), ("tweets", "20")]
    for col, (task, freeze) in enumerate(columns, start=1):
        runs = [f"docs/img/plain/{task}_{freeze}_s{seed}.json" for seed in (1, 2, 3)]
        report = _summarized(runs)
        for row in rows:
            if row[col] == "–":  # BinSGDM has no freeze: the 20% columns have no row of it
                assert row[0] == "BinSGDM" and freeze == "20"
                continue
            printed = next(ln for ln in report.splitlines() if ln.startswith(row[0]))
            for number in _numbers(row[col].replace("−", "-")):
                assert number in printed, f"results.md plain PyTorch: {row[0]} {task} {freeze}: {number} not in {printed!r}"


def test_the_plain_binsgdm_at_twice_the_lr_is_the_stored_runs():
    """results.md's sentence on BinSGDM at lr 2e-4 reprints ``--summarize`` of its stored runs."""
    results = _text("docs/results.md")
    for task in ("rotten_tomatoes", "tweets"):
        runs = [f"docs/img/plain/binsgdm_2e-4_{task}_auto_s{seed}.json" for seed in (1, 2, 3)]
        report = _summarized(runs)
        printed = next(ln for ln in report.splitlines() if ln.startswith("BinSGDM"))
        mean, se = printed.split()[-4:-2]
        assert f"**{mean}** ({se})" in results, f"BinSGDM at 2e-4 on {task}: {mean} ({se}) not in results.md"


def test_the_which_optimizer_table_is_results_figures():
    results = _text("docs/results.md").replace("−", "-")
    for row in _table_rows(_text("docs/getting-started.md"), "| `--optim` |"):
        for cell in row[1:4] + row[6:7]:
            for number in _numbers(cell.replace("−", "-")):
                if number in ("1", "3"):
                    continue  # "1 seed", "3 seeds"
                assert number in results, f"getting-started.md: {row[0]} {number} ({cell}) is not in results.md"


def test_the_readme_figures_are_results_figures():
    """The main job's report in README.md (accuracy, bytes ratio, freeze step) is results.md's run."""
    readme = _text("README.md")
    accuracy = float(re.search(r"^validation accuracy (0\.\d+)", readme, re.M).group(1))
    ratio = re.search(r"^ratio\s+([\d.]+x)$", readme, re.M).group(1)
    step = re.search(r"^warmup ended after step\s+(\d+)", readme, re.M).group(1)
    assert f"1-bit Adam {accuracy * 100:.2f}%, {ratio}, step {step}" in _text("docs/results.md")


def test_the_robustness_table_reprints_the_stored_grid():
    """results.md's worst cells against each method's own baseline are ``robustness.py --report`` of
    the stored runs, and the which-optimizer table's last column is the grid's worst cell."""
    files = ["bow_2ranks", "bow_2ranks_3seeds", "bow_2ranks_3seeds_precondition", "bow_2ranks_lamb_3seeds",
             "bow_2ranks_lamb_frozen_ratio", "bow_2ranks_zeroone_local_correction", "bow_8ranks",
             "bow_8ranks_3seeds", "bow_8ranks_3seeds_precondition", "bow_8ranks_lamb_3seeds",
             "bow_8ranks_lamb_frozen_ratio", "bow_8ranks_zeroone_local_correction", "teacher_3seeds",
             "teacher_lamb_3seeds", "teacher_zeroone_local_correction", "minilm_60", "minilm_60_precondition",
             "minilm_60_seeds345", "minilm_60_zeroone_local_correction", "minilm_lamb_240",
             "minilm_lamb_240_seeds34", "minilm_lamb_240_frozen_ratio", "minilm_lamb_240_seeds34_frozen_ratio",
             "minilm_60_tweets", "minilm_60_tweets_precondition", "minilm_60_tweets_zeroone_local_correction",
             "minilm_lamb_240_tweets", "minilm_lamb_240_tweets_frozen_ratio", "lm_2ranks", "lm_binsgdm_lr",
             "lm_240_blocks", "lm_240_precondition", "lm_240_lamb_frozen_ratio", "lm_60_1000",
             "lm_240_zeroone_local_correction", "lm_60_1000_zeroone_local_correction", "lm_240_x4_seeds23",
             "bow_2ranks_width_blocks", "teacher_width_blocks", "minilm_60_width_blocks", "minilm_60_tweets_width_blocks",
             "lm_width_blocks", "bow_8ranks_width_blocks", "minilm_lamb_240_width_blocks",
             "minilm_lamb_240_tweets_width_blocks", "teacher_lamb_step_bound", "bow_2ranks_lamb_step_bound",
             "bow_8ranks_lamb_step_bound", "lm_lamb_step_bound", "minilm_lamb_240_step_bound",
             "minilm_lamb_240_tweets_step_bound", "teacher_binsgdm_mean", "bow_2ranks_binsgdm_mean",
             "bow_8ranks_binsgdm_mean", "lm_binsgdm_mean", "lm_short_binsgdm_mean",
             "minilm_240_adam", "minilm_240_adam_tweets", "bow_2ranks_lamb_seeds456",
             "bow_2ranks_binsgdm_seeds456", "minilm_lamb_240_tweets_seeds34"]
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "robustness.py"), "--report",
                           *[str(REPO / "docs" / "img" / "robustness" / f"{f}.json") for f in files]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = _text("docs/results.md").replace("−", "-")
    assert "{" + ",".join(files) + "}.json" in results
    rows = {r[0]: r for r in _table_rows(results, "| method | bow: worst cell")}
    names = {"1-bit Adam": "onebit_adam", "0/1 Adam": "zeroone_adam", "1-bit LAMB": "onebit_lamb",
             "BinSGDM vs no vote": None, "BinSGDM vs exact mean": None, "BinSGDM": "binsgdm"}  # longer labels first
    which = {r[0].strip("`"): r for r in _table_rows(_text("docs/getting-started.md"), "| `--optim` |")}
    for line in proc.stdout.splitlines()[1:]:
        task, rest = line.split(None, 1)
        label = next(n for n in names if rest.startswith(n))
        gap = rest[len(label):].split()[0]  # "+2.30"
        column = {"bow": 1, "teacher": 2, "minilm": 3, "minilm-tweets": 4, "lm": 5}[task]
        assert rows[label][column].startswith(gap), f"results.md {label} {task}: {rows[label][column]} vs {line}"
        if task == "bow" and names[label]:
            assert which[names[label]][-1].startswith(gap.lstrip("+")), f"getting-started.md {label}: {gap}"
