"""Continuing from a DeepSpeed 1-bit Adam / 1-bit LAMB checkpoint: synthetic checkpoints in the
layouts DeepSpeed's stage-0 engine saved (fp32 per parameter, fp16 fused flat groups, fp16
unfused), their moments loaded, and the refusals."""

from __future__ import annotations

import io

import pytest
import torch

import hf_onebit
from hf_onebit.integrations.deepspeed_checkpoint import deepspeed_kind, load_deepspeed_state

SHAPES = [(4, 3), (4,), (2, 4)]
BETAS, EPS, LR = (0.9, 0.999), 1e-8, 1e-2


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def _moments(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g), torch.rand(s, generator=g) + 0.1) for s in SHAPES]


def _adam_entry(m, v, step, size):
    """A DeepSpeed 1-bit Adam parameter state (compression phase: with its error buffers)."""
    return {"step": step, "exp_avg": m, "exp_avg_sq": v, "tensor_size": size, "corrected_tensor_size": 16,
            "server_chunk_size": 8, "worker_error": torch.ones(16), "server_error": torch.ones(8)}


def _group(ids):
    return {"lr": LR, "bias_correction": False, "betas": BETAS, "eps": EPS, "weight_decay": 0.0,
            "max_grad_norm": 0.0, "params": ids}


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _engine(optimizer_state):
    """mp_rank_00_model_states.pt of a stage-0 engine (the model weights beside the optimizer)."""
    return {"module": {"w": torch.zeros(1)}, "optimizer": optimizer_state, "global_steps": 7}


def test_fp32_per_parameter_layout_continues_deepspeeds_trajectory():
    moments = _moments()
    ds = _engine({"state": {i: _adam_entry(m, v, 7, m.numel()) for i, (m, v) in enumerate(moments)},
                  "param_groups": [_group([0, 1, 2])]})
    params = _params()
    # what `hf-onebit from-deepspeed` gives for freeze_step 5: 4 here
    opt = hf_onebit.OneBitAdam(params, lr=LR, freeze_step=4, bias_correction=False, defaults="paper")
    assert deepspeed_kind(ds) == "OneBitAdam"
    assert load_deepspeed_state(opt, _round_trip(ds)) == 6  # DeepSpeed's step 7 = 6 updates here
    assert opt.phase() == "compression"  # DeepSpeed: step 7 >= freeze_step 5, compressing too
    for p, (m, v) in zip(params, moments):
        assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)
    # the next step is DeepSpeed's (no bias correction, frozen variance; one process: no exchange)
    before = [p.detach().clone() for p in params]
    grads = [torch.randn(s) for s in SHAPES]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, p0, g, (m, v) in zip(params, before, grads, moments):
        m1 = BETAS[0] * m + (1 - BETAS[0]) * g
        torch.testing.assert_close(p.detach(), p0 - LR * m1 / (v.sqrt() + EPS))
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)


def test_fp16_fused_flat_groups_are_split_back_per_parameter():
    moments = _moments()
    flat_m = torch.cat([m.reshape(-1) for m, _ in moments[:2]])
    flat_v = torch.cat([v.reshape(-1) for _, v in moments[:2]])
    ds = {"dynamic_loss_scale": True, "cur_scale": 2.0**12, "cur_iter": 30, "last_overflow_iter": 3,
          "scale_factor": 2.0, "scale_window": 1000, "clip_grad": 1.0,
          "optimizer_state_dict": {"state": {0: _adam_entry(flat_m, flat_v, 3, flat_m.numel()),
                                             1: _adam_entry(moments[2][0].reshape(-1), moments[2][1].reshape(-1), 3, 8)},
                                   "param_groups": [_group([0]), _group([1])]},
          "fp32_groups_flat": [torch.zeros(flat_m.numel()), torch.zeros(8)]}
    params = _params()
    opt = hf_onebit.OneBitAdam([{"params": params[:2]}, {"params": params[2:]}], lr=LR, freeze_step=10,
                               bias_correction=False, defaults="paper")
    assert load_deepspeed_state(opt, _round_trip(ds)) == 2
    assert opt.phase() == "warmup"
    for p, (m, v) in zip(params, moments):
        assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)


def test_onebit_lamb_takes_its_trust_ratio_factor_scaling_and_fresh_variance():
    moments = _moments()
    state = {}
    for i, (m, v) in enumerate(moments):
        state[i] = {"step": 9, "lamb_coeff_freeze": 0.5 + i, "last_factor": 1.1, "exp_avg": m, "exp_avg_sq": v,
                    "exp_avg_sq_fresh": v * 2, "scaling_coeff": 0.25 * (i + 1)}
    ds = {"dynamic_loss_scale": True, "cur_scale": 2.0**12, "cur_iter": 9,
          "optimizer_state_dict": {"state": state, "param_groups": [_group([0, 1, 2])]},
          "fp32_groups": [[torch.zeros(s) for s in SHAPES]]}
    params = _params()
    opt = hf_onebit.OneBitLamb(params, lr=LR, freeze_step=4, defaults="paper")
    assert deepspeed_kind(ds) == "OneBitLamb"
    assert load_deepspeed_state(opt, _round_trip(ds)) == 8 and opt.phase() == "compression"
    for i, (p, (m, v)) in enumerate(zip(params, moments)):
        st = opt.state[p]
        assert torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], v)
        assert torch.equal(st["exp_avg_sq_fresh"], v * 2)
        assert float(st["coeff_frozen"]) == 0.5 + i and float(st["scaling"]) == 0.25 * (i + 1)
        assert float(st["last_factor"]) == pytest.approx(1.1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # a compression step on one process runs on the loaded state
    assert all(torch.isfinite(p).all() for p in params)


def _adam_ds(step=7):
    return {"state": {i: _adam_entry(m, v, step, m.numel()) for i, (m, v) in enumerate(_moments())},
            "param_groups": [_group([0, 1, 2])]}


@pytest.mark.parametrize("checkpoint, make, words", [
    ({"module": {}, "optimizer": None}, "adam", "holds no optimizer state"),
    ({"base_optimizer_state": {}, "single_partition_of_fp32_groups": [], "partition_count": [2]}, "adam",
     "partitioned DeepSpeed optimizer state"),
    ({"state": {0: {"step": 3, "exp_avg": torch.zeros(4, 3), "exp_avg_sq": torch.zeros(4, 3)}},
      "param_groups": [_group([0])]}, "adam", "torch Adam/AdamW state"),
    ({"state": {0: {"step": 3, "exp_avg": torch.zeros(12), "exp_avg_sq": torch.zeros(12), "var_interval": 1,
                    "momentum_accumulator": torch.zeros(12)}}, "param_groups": [_group([0])]}, "adam",
     "0/1 Adam state is not loaded"),
    ({"state": {}, "param_groups": [_group([])]}, "adam", "empty"),
    ({"foo": 1}, "adam", "not a DeepSpeed optimizer state"),
    (_adam_ds(), "lamb", "the checkpoint is DeepSpeed's OneBitAdam, the optimizer hf_onebit.OneBitLamb"),
    ({"state": _adam_ds()["state"], "param_groups": [_group([0, 1])]}, "adam", "no flat layout matches"),
    ({"state": _adam_ds()["state"], "param_groups": [_group([0]), _group([1, 2])]}, "adam", "2 parameter group(s)"),
])
def test_what_cannot_be_loaded_is_refused_with_the_reason(checkpoint, make, words):
    params = _params()
    opt = (hf_onebit.OneBitLamb(params, freeze_step=4) if make == "lamb"
           else hf_onebit.OneBitAdam(params, freeze_step=4))
    with pytest.raises(ValueError) as info:
        load_deepspeed_state(opt, checkpoint)
    assert words in str(info.value)
    assert opt.steps_done == 0 and not opt.state


def test_a_moment_of_another_size_is_refused():
    ds = _adam_ds()
    ds["state"][1]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match="not the same model"):
        load_deepspeed_state(hf_onebit.OneBitAdam(_params(), freeze_step=4), ds)
