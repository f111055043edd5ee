"""The onebit/* figures reach TensorBoard through transformers' own TensorBoardCallback, as scalars.

A tiny OneBitTrainer run on 2 gloo processes (`accelerate launch`, the CPU recipe) with
``--report_to tensorboard``; the event file rank 0 wrote is read back with TensorBoard's
EventAccumulator. Also checked on the console: the step the automatic freeze chose, the phase
change and the end-of-training summary are printed once (hf_onebit logs them at INFO, which the
integration lets through by default), and the logged phase turns from 0 to 1 after that step.
"""

from __future__ import annotations

import re

from tests.integrations.launch import SCRIPTS, accelerate_launch, base_env
from tests.requirements import require

require("tensorboard", "the event-file test reads TensorBoard's files (pip install tensorboard)")

#: the keys every training log carries once something was sent (see hf_onebit.integrations.logs)
NUMERIC = ("phase", "bytes_per_step", "bytes_sent", "compression_ratio", "ratio_vs_ddp",
           "comm_ms", "compress_ms", "exchange_ms", "exchange_wait_ms", "hidden_share")
TIME = ("comm_ms", "exchange_wait_ms", "hidden_share")


def test_tensorboard_event_file_holds_numeric_onebit_scalars_time_among_them(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    env = {**base_env(), "TENSORBOARD_LOGGING_DIR": str(tb)}  # where transformers' callback writes
    res = accelerate_launch(
        [str(SCRIPTS / "onebit_train.py"), "--output_dir", str(tmp_path / "out"), "--optim", "onebit_adam",
         "--max_steps", "20", "--logging_steps", "2", "--per_device_train_batch_size", "8",  # the automatic freeze
         "--bucket_kb", "24", "--save_strategy", "no", "--disable_tqdm", "true", "--report_to", "tensorboard"],
        env=env, timeout=300,
    ).check()

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
    chosen = re.findall(r"auto freeze chose step (\d+)", res.output)
    assert len(chosen) == 1, res.output[-3000:]
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
    assert res.output.count(f"step {freeze} done, entering phase 'compression'") == 1, res.output[-3000:]
    summary = [line for line in res.output.splitlines() if line.startswith("hf_onebit OneBitAdam on 2 ranks, 20 steps")]
    assert len(summary) == 1, res.output[-3000:]
    assert "where fp32 DDP sends" in summary[0] and "communication ran" in summary[0] and "s of communication time" in summary[0]
