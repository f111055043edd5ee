"""OneBitTrainer on 2 gloo processes started by `accelerate launch` with the CPU recipe.

For each --optim name: run A trains 24 steps (gradient accumulation 2, 3 DDP buckets, a
checkpoint at step 12); run B resumes from A's checkpoint-12 in a fresh output directory.
Checked: the loss falls, the logs carry the compression figures, the hook fires once per bucket
per optimizer step, and B ends with parameters bitwise equal to A's on every rank. A last run
reports to TensorBoard, whose event file must hold the onebit/* figures as scalars. All the runs
share one launch (the script's cases file), which pays the processes' start-up once.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter

import pytest
import torch

from tests.integrations.launch import SCRIPTS, accelerate_launch, base_env
from tests.requirements import require

COMMON = [
    "--max_steps", "24", "--save_steps", "12", "--per_device_train_batch_size", "8",
    "--gradient_accumulation_steps", "2", "--logging_steps", "4", "--logging_first_step",
    "--report_to", "none", "--disable_tqdm", "true", "--bucket_kb", "24",
]

CASES = {
    # --check_grad: step 1's gradient norm must be the plain mean over the global batch (needs dropout 0),
    # to 1e-4: so the warmup's gradient goes in fp32 (warmup_bits=none, the paper's), not at the library
    # default's 8 bits (whose rounding moves that norm by ~1e-3; the other cases run their own default:
    # 8 bits, full precision for 0/1 Adam's variance steps)
    "onebit_adam": ["--freeze_step", "8", "--learning_rate", "3e-3", "--dropout", "0", "--check_grad",
                    "--optim_args", "warmup_bits=none",
                    "--eval_strategy", "steps", "--eval_steps", "12", "--per_device_eval_batch_size", "16"],
    "zeroone_adam": ["--var_freeze_step", "8", "--optim_args", "var_update_scaler=2,local_step_scaler=4",
                     "--local_step_clipper", "4", "--learning_rate", "3e-3"],
    "onebit_lamb": ["--freeze_step", "8", "--learning_rate", "1e-2", "--bf16", "--use_cpu"],
    "binsgdm": ["--learning_rate", "3e-3", "--max_grad_norm", "0"],
}

# How far the mean of the last two logged losses falls below the first two. 1-bit LAMB with the
# integration's update_clip=1.0 (bf16, 16 compressed steps of this toy) fell by 0.066 (0.71 -> 0.64).
LOSS_DROP = {"onebit_lamb": 0.05}

# onebit/phase at the first and the last log: 0 the first phase (warmup, variance), 1 the last
# (compression, local_steps; BinSGDM has one phase, the vote)
PHASES = {
    "onebit_adam": (0, 1),
    "zeroone_adam": (0, 1),
    "onebit_lamb": (0, 1),
    "binsgdm": (1, 1),
}


def _args(tmp, name, run, resume=None):
    args = ["--output_dir", str(tmp / name / run), "--result_dir", str(tmp / name / f"res{run}"),
            "--optim", name, *COMMON, *CASES[name]]
    return args + (["--resume", str(resume)] if resume else [])


# and the run that reports to TensorBoard (the last test reads its event file): the automatic freeze, 20 steps
TENSORBOARD_RUN = ["--optim", "onebit_adam", "--max_steps", "20", "--logging_steps", "2",
                   "--per_device_train_batch_size", "8", "--bucket_kb", "24", "--save_strategy", "no",
                   "--disable_tqdm", "true", "--report_to", "tensorboard"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every optimizer's run A, then every run B resumed from A's checkpoint-12, then the
    TensorBoard run, in one launch; returns the folder and each run's console output (rank 0's)."""
    tmp = tmp_path_factory.mktemp("trainer")
    cases = [_args(tmp, name, "A") for name in CASES]
    cases += [_args(tmp, name, "B", resume=tmp / name / "A" / "checkpoint-12") for name in CASES]
    if importlib.util.find_spec("tensorboard"):  # else its test skips (and fails under CI)
        cases.append(["--output_dir", str(tmp / "tensorboard_out"), *TENSORBOARD_RUN])
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**base_env(), "TENSORBOARD_LOGGING_DIR": str(tmp / "tb")}  # where transformers' callback writes
    res = accelerate_launch([str(SCRIPTS / "onebit_train.py"), str(tmp / "cases.json")], env=env, timeout=600).check()
    outputs = re.split(r"^onebit_train: run \d+$", res.output, flags=re.M)[1:]
    assert len(outputs) == len(cases), res.output[-3000:]
    return tmp, outputs


def _results(tmp, name, run):
    return [torch.load(tmp / name / f"res{run}" / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_train_log_and_resume_bitwise(runs, name):
    tmp, _ = runs
    a, b = _results(tmp, name, "A"), _results(tmp, name, "B")
    checkpoint = tmp / name / "A" / "checkpoint-12"
    assert sorted(p.name for p in (checkpoint / "hf_onebit").iterdir()) == ["hf_onebit_rank0_of2.json", "hf_onebit_rank0_of2.pt", "hf_onebit_rank1_of2.json", "hf_onebit_rank1_of2.pt"]

    for rank in range(2):
        assert a[rank]["world_size"] == 2
        # the resumed run continues the same trajectory, bitwise
        pa, pb = a[rank]["params"], b[rank]["params"]
        assert pa.keys() == pb.keys()
        different = [k for k in pa if not torch.equal(pa[k], pb[k])]
        assert not different, f"rank {rank}: resumed parameters differ from the uninterrupted run: {different[:5]}"
        # BERT's forward takes **kwargs but its loss ignores num_items_in_batch: the integration turns it off
        assert a[rank]["model_accepts_loss_kwargs"] is False

    logs = [h for h in a[0]["log_history"] if "loss" in h]
    assert [h["step"] for h in logs] == [1, 4, 8, 12, 16, 20, 24]
    losses = [h["loss"] for h in logs]
    assert losses[0] < 0.8, f"the logged loss must be a plain mean (ln 2 = 0.69 at the start), got {losses[0]}"
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - LOSS_DROP.get(name, 0.1), f"loss does not fall: {losses}"
    for h in logs:
        for key in ("onebit/phase", "onebit/bytes_per_step", "onebit/bytes_sent", "onebit/compression_ratio",
                    "onebit/ratio_vs_ddp", "onebit/comm_ms", "onebit/exchange_wait_ms", "onebit/hidden_share"):
            assert key in h, f"{key} missing from the log at step {h['step']}: {sorted(h)}"
        assert h["onebit/comm_ms"] > 0 and 0 <= h["onebit/hidden_share"] <= 1
    first, last = PHASES[name]
    assert logs[0]["onebit/phase"] == first and logs[-1]["onebit/phase"] == last
    sent = [h["onebit/bytes_sent"] for h in logs]
    assert sent == sorted(sent) and sent[0] > 0
    if name != "binsgdm":  # compression after the first phase: far fewer bytes per step than the warmup
        # whose gradient goes at 8 bits (warmup_bits=8, the library default, plus a 4-byte scale per 32 elements:
        # ~32/9 = 3.6x fewer bytes than fp32) or
        # in fp32 (warmup_bits=none); the 1-bit phase sends ~8x fewer bytes than the first, ~32x than the second
        from hf_onebit.optim.defaults import LIBRARY

        library_bits = LIBRARY[{"onebit_adam": "OneBitAdam", "zeroone_adam": "ZeroOneAdam", "onebit_lamb": "OneBitLamb"}[name]]
        fp32_warmup = "warmup_bits=none" in CASES[name] or library_bits["warmup_bits"] is None
        assert logs[0]["onebit/compression_ratio"] == (1.0 if fp32_warmup else pytest.approx(32 / 9, rel=0.15))
        assert logs[-1]["onebit/bytes_per_step"] < logs[0]["onebit/bytes_per_step"] / (10 if fp32_warmup else 6)
    assert logs[-1]["onebit/ratio_vs_ddp"] > 1.5
    # the resumed run's logs continue the cumulative figures (BinSGDM frames its votes per DDP bucket, and
    # DDP's first iteration after the resume has a single bucket: a few bytes of flags and padding differ)
    logs_b = {h["step"]: h for h in b[0]["log_history"] if "loss" in h}
    assert logs_b[24]["onebit/bytes_sent"] == pytest.approx(logs[-1]["onebit/bytes_sent"], rel=1e-3)
    if name == "binsgdm":
        # Exactly why: each rank sends, per bucket, a 4-byte flag and its votes padded to whole bytes
        # ((n-1)·(4 + ceil(N/8)) with N padded to 8). The resumed run's step 13 is its DDP's first iteration,
        # which has one bucket; the uninterrupted run's step 13 has the 3 rebuilt buckets: two flags more.
        def framed(result, step):
            return sum(4 + -(-numel // 8) for s, numel in result["bucket_numels"] if s == step)

        for rank in range(2):
            assert [s for s, _ in b[rank]["bucket_numels"]].count(13) == 1
        expected = framed(a[0], 13) - framed(b[0], 13)
        assert expected == 8  # the 8 bytes of the issue: 3 flags against 1, the padding is the same
        assert logs[-1]["onebit/bytes_sent"] - logs_b[24]["onebit/bytes_sent"] == expected
        assert all(framed(a[0], s) == framed(b[0], s) for s in range(14, 25))  # later steps: the same buckets

    # gradient accumulation: no_sync on the first micro-batch, so the hook runs once per bucket per step
    calls = Counter(step for step, _ in a[0]["calls"])
    assert sorted(calls) == list(range(1, 25))
    assert calls[1] == 1  # DDP's first iteration: one bucket with every parameter
    assert {calls[s] for s in range(2, 25)} == {3}  # then the 3 rebuilt buckets, never per micro-batch

    if name == "onebit_adam":
        evals = [h for h in a[0]["log_history"] if "eval_loss" in h]
        assert [h["step"] for h in evals] == [12, 24] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
        assert not any(k.startswith("onebit/") for h in evals for k in h)
        expected = a[0]["plain_mean_grad_norm_step1"]
        assert logs[0]["grad_norm"] == pytest.approx(expected, rel=1e-4), (
            "the gradient must be the plain mean over the global batch (not multiplied by accumulation x processes)"
        )


#: the keys every training log carries once something was sent (see hf_onebit.integrations.logs)
NUMERIC = ("phase", "bytes_per_step", "bytes_sent", "compression_ratio", "ratio_vs_ddp",
           "comm_ms", "compress_ms", "exchange_ms", "exchange_wait_ms", "hidden_share")
TIME = ("comm_ms", "exchange_wait_ms", "hidden_share")


def test_tensorboard_event_file_holds_numeric_onebit_scalars_time_among_them(runs):
    """The onebit/* figures reach TensorBoard through transformers' own TensorBoardCallback, as
    scalars: the event file rank 0 wrote, read back with TensorBoard's EventAccumulator. On the
    console: the step the automatic freeze chose, the phase change and the end-of-training summary
    are printed once (hf_onebit logs them at INFO, which the integration lets through by default),
    and the logged phase turns from 0 to 1 after that step."""
    require("tensorboard", "the event-file test reads TensorBoard's files (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, outputs = runs
    tb, output = tmp / "tb", outputs[-1]
    files = list(tb.glob("events.out.tfevents.*"))
    assert len(files) == 1, f"rank 0 alone writes one event file: {files}"
    events = EventAccumulator(str(tb), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    scalars = {t for t in tags["scalars"] if t.startswith("train/onebit/")}  # transformers prefixes train/
    assert {f"train/onebit/{k}" for k in NUMERIC} <= scalars, sorted(scalars)
    # strings become text entries (tensors of the text plugin): the Trainer's "args" is one (args/text_summary), no onebit key is
    assert "args/text_summary" in tags["tensors"]
    assert not [t for t in tags["tensors"] if "onebit" in t], tags["tensors"]

    def series(key):
        return {e.step: e.value for e in events.Scalars(f"train/onebit/{key}")}

    # the console names the step the automatic freeze chose (once, rank 0): the warmup's last step
    chosen = re.findall(r"auto freeze chose step (\d+)", output)
    assert len(chosen) == 1, output[-3000:]
    freeze = int(chosen[0])
    logged = list(range(2, 21, 2))
    phase = series("phase")
    assert sorted(phase) == logged
    assert all(phase[s] == (0 if s <= freeze else 1) for s in logged), (freeze, phase)  # 0 warmup, 1 compression
    assert 1 in phase.values()
    per_step = series("bytes_per_step")
    assert per_step[20] < per_step[2] / 4  # 1-bit against the 8-bit warmup
    for step in logged:
        comm, wait, hidden = (series(k)[step] for k in TIME)
        assert comm > 0 and 0 <= wait and 0 <= hidden <= 1, (step, comm, wait, hidden)
        # the exchange marks its stages (comm/compressed.py): kernels and collectives are parts of the jobs' time
        compress, exchange = series("compress_ms")[step], series("exchange_ms")[step]
        assert compress > 0 and exchange > 0 and compress + exchange <= comm * 1.001, (step, compress, exchange, comm)

    # the console: the phase change and the summary, once each (rank 0)
    assert output.count(f"step {freeze} done, entering phase 'compression'") == 1, output[-3000:]
    summary = [line for line in output.splitlines() if line.startswith("hf_onebit OneBitAdam on 2 ranks, 20 steps")]
    assert len(summary) == 1, output[-3000:]
    assert "where fp32 DDP sends" in summary[0] and "communication ran" in summary[0] and "s of communication time" in summary[0]
