"""Megatron-LM's optimizer-schedule and run flags, mostly in-process.

- The LR / weight-decay schedule (samples-based, WSD, --lr-warmup-init, --weight-decay-incr-style)
  is megatron-core's OptimizerParamScheduler with the lengths Megatron-LM's
  get_optimizer_param_scheduler gives it: checked against a scheduler built from those numbers
  by hand and against closed-form values.
- --decoupled-lr: megatron-core's param groups on CPU too; the embedding and output layer follow
  their own schedule, the rest --lr (two gloo ranks, with the DP-replica weight hash and
  --data-parallel-random-init's dropout seeds).
- --rampup-batch-size / --step-batch-size-schedule: the pure function against megatron-core's
  calculators where the installed version has them, and closed-form values; the config errors.
- The profiler writes a trace of the given steps; --manual-gc turns the collector off and on;
  --rerun-mode disabled skips the loss check.
- One pretrain_gpt.py story: a ramp at SP 2 equals SP 1, and a resume from its mid-ramp checkpoint
  equals it.
"""

import gc
import gzip
import json
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from distributed import spawn
from megatron.core import num_microbatches_calculator as calculators
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from test_cli import launch, losses

from megatron_ulysses.training import batch_schedule as bs
from megatron_ulysses.training.arguments import ConfigError, parse_args
from megatron_ulysses.training.model import build_scheduler

BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--mock-data", "--vocab-size", "64",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "1e-3", "--min-lr", "1e-4"]


class _Groups:
    """What the scheduler drives: an object with `param_groups`."""

    def __init__(self, *groups):
        self.param_groups = [dict(group) for group in groups]


def _values(scheduler, increments):
    out = []
    for increment in increments:
        scheduler.step(increment)
        out.append([(g["lr"], g["weight_decay"]) for g in scheduler.optimizer.param_groups])
    return out


# --- the LR / weight-decay schedule ---------------------------------------------------------

SAMPLES_RUN = ["--global-batch-size", "4", "--train-samples", "40", "--lr-warmup-samples", "8",
               "--lr-decay-samples", "32", "--lr-warmup-init", "1e-4", "--lr-decay-style",
               "WSD", "--lr-wsd-decay-style", "cosine", "--lr-wsd-decay-samples", "12",
               "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.01",
               "--end-weight-decay", "0.1"]


def test_samples_schedule_is_megatron_lms():
    config = parse_args(BASE + SAMPLES_RUN, world_size=1).optimizer
    groups = ({"wd_mult": 1.0}, {"wd_mult": 0.0})
    ours = build_scheduler(config, _Groups(*groups))
    # Megatron-LM's get_optimizer_param_scheduler with --train-samples: lengths in samples.
    theirs = OptimizerParamScheduler(
        _Groups(*groups), init_lr=1e-4, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=8,
        lr_decay_steps=32, lr_decay_style="WSD", start_wd=0.01, end_wd=0.1, wd_incr_steps=40,
        wd_incr_style="linear", wsd_decay_steps=12, lr_wsd_decay_style="cosine")
    increments = [4] * 10
    got = _values(ours, increments)
    assert got == _values(theirs, increments)
    lr = [step[0][0] for step in got]
    assert lr[0] == pytest.approx(1e-4 + 0.9e-3 * 4 / 8)  # warmup from --lr-warmup-init
    assert lr[1:5] == pytest.approx([1e-3] * 4)  # stable until 32 - 12 samples
    assert lr[5] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (math.cos(math.pi * 4 / 12) + 1))
    assert lr[7:] == pytest.approx([1e-4] * 3)  # annealed to --min-lr at 32 samples
    wd = [step[0][1] for step in got]
    assert wd[4] == pytest.approx(0.01 + 0.09 * 20 / 40) and wd[-1] == pytest.approx(0.1)
    assert all(step[1][1] == 0.0 for step in got)  # wd_mult 0 (biases, norms)


def test_iteration_schedule_counts_samples_of_the_global_batch():
    config = parse_args(BASE + ["--global-batch-size", "4", "--train-iters", "10",
                                "--lr-warmup-fraction", "0.25", "--lr-decay-style", "WSD",
                                "--lr-wsd-decay-iters", "2"], world_size=1).optimizer
    assert (config.lr_warmup_steps, config.lr_decay_steps, config.wsd_decay_steps,
            config.wd_incr_steps) == (10, 40, 8, 40)


@pytest.mark.parametrize("flags, message", [
    (["--train-iters", "4", "--lr-warmup-samples", "2"], "--lr-warmup-samples"),
    (["--train-iters", "4", "--lr-decay-samples", "2"], "--lr-decay-iters"),
    (["--train-samples", "8", "--lr-decay-iters", "2"], "--lr-decay-samples"),
    (["--train-samples", "8", "--lr-warmup-iters", "1"], "--lr-warmup-samples"),
    (["--train-samples", "8", "--lr-warmup-samples", "8"], "--lr-decay-samples"),
    (["--train-iters", "4", "--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
    (["--train-iters", "4", "--weight-decay-incr-style", "cosine"], "--end-weight-decay"),
    (["--train-iters", "4", "--start-weight-decay", "0.1"], "--weight-decay-incr-style"),
    (["--train-iters", "4", "--decoupled-lr", "1e-5"], "--decoupled-lr"),
    (["--train-iters", "4", "--lr-warmup-init", "1"], "--lr-warmup-init"),
    (["--train-iters", "4", "--check-for-spiky-loss"], "--check-for-spiky-loss"),
    (["--train-iters", "4", "--rerun-mode", "report_stats"], "report_stats"),
    (["--train-iters", "4", "--eval-global-batch-size", "3", "--eval-micro-batch-size", "2"],
     "--eval-global-batch-size"),
    (["--train-iters", "4", "--profile", "--profile-step-start", "3", "--profile-step-end",
      "3"], "--profile-step-end"),
])
def test_bad_schedule_flags_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(BASE + flags, world_size=1)


# --- decoupled LR through megatron-core's param groups, on CPU ----------------------------

def _decoupled_worker(rank, world):
    from megatron_ulysses import cpu_compat
    from megatron_ulysses.sp import parallel_state as ps
    from megatron_ulysses.training import model as builders
    from megatron_ulysses.training.arguments import padded_vocab_size
    from megatron_ulysses.training.loop import dropout_base_seed
    from megatron_ulysses.training.step_hooks import weights_match_across_replicas

    cpu_compat.install()
    config = parse_args(BASE + ["--global-batch-size", "2", "--train-iters", "6",
                                "--lr-warmup-iters", "2", "--lr-decay-style", "linear",
                                "--decoupled-lr", "5e-3", "--decoupled-min-lr", "2e-3",
                                "--untie-embeddings-and-output-weights"], world_size=world)
    config = config.with_padded_vocab_size(padded_vocab_size(64, 128, 1))
    ps.initialize_model_parallel(dims=config.dims)
    try:
        model, optimizer, scheduler = builders.build_model_and_optimizer(config)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        named = dict(model.named_parameters())
        embedding = group_of[id(named["module.embedding.word_embeddings.weight"])]
        output = group_of[id(named["module.output_layer.weight"])]
        linear = group_of[id(named["module.decoder.layers.0.mlp.linear_fc1.weight"])]
        assert embedding is output and embedding is not linear
        assert embedding["weight_decay"] == linear["weight_decay"] == 0.01
        got = []
        for _ in range(6):
            scheduler.step(increment=2)
            got.append((embedding["lr"], linear["lr"]))
        # warmup 2 iterations to each group's max, then linear to its min over 6.
        assert got[0] == pytest.approx((2.5e-3, 5e-4))
        assert got[3] == pytest.approx((5e-3 - 3e-3 * 2 / 4, 1e-3 - 9e-4 * 2 / 4))
        assert got[5] == pytest.approx((2e-3, 1e-4))
        assert weights_match_across_replicas(model)
        if rank == 1:
            with torch.no_grad():
                named["module.decoder.final_layernorm.weight"].add_(1e-3)
        assert not weights_match_across_replicas(model)  # every rank sees the difference
        seeds = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        random_init = parse_args(BASE + ["--train-iters", "2", "--data-parallel-random-init",
                                         "--seed", "7"], world_size=world).training
        dist.all_gather(seeds, torch.tensor([dropout_base_seed(random_init)]))
        assert [int(seed) for seed in seeds] == [7, 17]  # Megatron-LM's seed + 10 x DP rank
        assert dropout_base_seed(config.training) == config.training.seed
        _check_wd_on_qk_layernorm(world)
    finally:
        ps.destroy_model_parallel()


def _check_wd_on_qk_layernorm(world):
    """--apply-wd-to-qk-layernorm: megatron-core's overrides decay the q/k norms, no other
    1-D parameter."""
    from megatron_ulysses.training import model as builders
    from megatron_ulysses.training.optimizer import mcore_optimizer_config, param_groups

    for flags, qk_mult in (([], 0.0), (["--apply-wd-to-qk-layernorm"], 1.0)):
        config = parse_args(BASE + ["--train-iters", "2", "--qk-layernorm"] + flags,
                            world_size=world).with_padded_vocab_size(128)
        model = builders.build_model(config.model, config.optimizer, config.training.seed,
                                     builders.transformer_config(config.model, config.dims))
        groups = param_groups(model, mcore_optimizer_config(config.optimizer, config.model))
        mult = {name: g["wd_mult"] for name, p in model.named_parameters() for g in groups
                if any(p is q for q in g["params"])}
        attention = "module.decoder.layers.0.self_attention."
        assert mult[attention + "q_layernorm.weight"] == qk_mult
        assert mult[attention + "k_layernorm.weight"] == qk_mult
        assert mult["module.decoder.final_layernorm.weight"] == 0.0
        assert mult[attention + "linear_qkv.weight"] == 1.0


def test_decoupled_lr_uses_megatron_core_param_groups_on_cpu():
    spawn(_decoupled_worker, 2)


# --- batch-size ramps -------------------------------------------------------------------------

def test_rampup_is_megatron_core_016s_ramp():
    schedule = bs.rampup_schedule((2, 2, 30), 8)  # 2 -> 8 by 2 over 30 samples: 3 increments
    got = [bs.global_batch_size_at(c, schedule, 8) for c in range(40)]
    assert got == [2] * 10 + [4] * 10 + [6] * 10 + [8] * 10
    if hasattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator"):
        theirs = calculators.RampupBatchsizeNumMicroBatchesCalculator(
            8, 1, 2, False, 1, 2, 2, 30)
        expected = []
        for consumed in range(40):
            theirs.update(consumed, consistency_check=True)
            expected.append(theirs.get_current_global_batch_size())
        assert got == expected


def test_step_schedule_thresholds_are_tokens():
    schedule = bs.parse_step_schedule("0:2 1K:4, 0.004M:8", seq_length=100)
    assert schedule == ((0, 2), (10, 4), (40, 8))
    assert [bs.global_batch_size_at(c, schedule, 2) for c in (0, 9, 10, 39, 40, 10**6)] == \
        [2, 2, 4, 4, 8, 8]
    # Megatron-LM's update_train_iters: iterations until the samples are consumed.
    assert bs.iterations_for(20, schedule, 2) == 8  # 5 x 2 then 3 x 4 (22 >= 20)
    assert bs.samples_after(8, schedule, 2) == 22
    if hasattr(calculators, "StepBatchsizeNumMicroBatchesCalculator"):
        theirs = calculators.StepBatchsizeNumMicroBatchesCalculator(
            1, 2, False, 1, "0:2 1K:4, 0.004M:8", seq_length=100)
        for consumed in (0, 9, 10, 39, 40, 1000):
            theirs.update(consumed, consistency_check=False)
            assert theirs.get_current_global_batch_size() == \
                bs.global_batch_size_at(consumed, schedule, 2)


@pytest.mark.parametrize("flags, message", [
    (["--step-batch-size-schedule", "0:2 64:4", "--global-batch-size", "4"],
     "--global-batch-size"),
    (["--step-batch-size-schedule", "16:2"], "threshold 0"),
    (["--step-batch-size-schedule", "0:2 32:3"], r"\[3\]"),
    (["--step-batch-size-schedule", "0:2 8:4"], "increase"),
    (["--rampup-batch-size", "2", "3", "8", "--global-batch-size", "6"], "INCREMENT"),
])
def test_bad_batch_ramps_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(BASE + ["--train-samples", "64"] + flags, world_size=2)


def test_train_samples_under_a_ramp_counts_iterations_as_megatron_lm():
    config = parse_args(BASE + ["--train-samples", "20", "--step-batch-size-schedule",
                                "0:2 160:4"], world_size=1)
    assert config.training.train_iters == 8  # 10 samples at 2, then 3 x 4
    assert config.training.global_batch_size == 1  # Megatron-LM: micro x DP (not the schedule)


# --- profiler, manual GC ----------------------------------------------------------------------

def _hooks_worker(rank, world, tmp_path):
    from megatron_ulysses.training.step_hooks import StepHooks

    config = parse_args(BASE + ["--train-iters", "6", "--profile", "--use-pytorch-profiler",
                                "--profile-step-start", "2", "--profile-step-end", "4",
                                "--manual-gc", "--manual-gc-interval", "3", "--tensorboard-dir",
                                str(tmp_path / "tb")], world_size=world)
    with mock.patch.object(gc, "collect") as collect:
        hooks = StepHooks(config.training, config.logging.tensorboard_dir)
        assert not gc.isenabled() and collect.call_count == 1
        for iteration in range(6):
            hooks.before_step(iteration)
            with torch.profiler.record_function(f"work-{iteration}"):
                torch.ones(8).sum()
            hooks.after_step(iteration + 1, None)
        assert collect.call_count == 3  # the start, iterations 3 and 6
        with hooks.around_evaluation():
            pass
        assert collect.call_count == 5
        hooks.close()
    assert gc.isenabled()
    # --rerun-mode disabled: Megatron-LM's rerun machine then checks no loss (grads still are).
    from megatron_ulysses.training.schedule import NonFiniteError, check_finite

    nan_loss = torch.tensor([float("nan"), 4.0], dtype=torch.float64)
    check_finite(nan_loss, torch.nn.Linear(2, 2), check_grads=False, check_loss=False)
    with pytest.raises(NonFiniteError, match="loss is NaN"):
        check_finite(nan_loss, torch.nn.Linear(2, 2), check_grads=False)


def test_profiler_traces_the_given_steps_and_manual_gc(tmp_path):
    spawn(_hooks_worker, 1, tmp_path)
    with gzip.open(tmp_path / "torch_profile" / "rank-0.json.gz") as trace:
        events = json.load(trace)["traceEvents"]
    names = {event.get("name") for event in events}
    assert {name for name in names if name.startswith("ProfilerStep")} == \
        {"ProfilerStep#2", "ProfilerStep#3"}
    assert {name for name in names if name.startswith("work-")} == {"work-1", "work-2"}


# --- one pretrain_gpt.py story: a ramp at SP 2 = SP 1, and a resume mid-ramp -------------------

def test_batch_ramp_at_sp2_equals_sp1_and_resumes_mid_ramp(tmp_path):
    flags = ["--mock-data", "--vocab-size", "256", "--train-samples", "28", "--eval-iters", "0",
             "--step-batch-size-schedule", "0:4 512:8", "--lr-warmup-samples", "4",
             "--decoupled-lr", "3e-3", "--check-weight-hash-across-dp-replicas-interval", "2"]
    run = ["--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1",
           "--num-workers", "0"]
    # The SP 2 run saves iteration 2, mid-ramp, on its way; its tracker set back to 2 (as a user
    # picks an older checkpoint) makes it a run stopped there.
    ckpt = tmp_path / "ckpt"
    sp2 = launch(2, *flags, "--ulysses-sp-size", "2", "--save", str(ckpt), "--save-interval",
                 "2", run=run)
    full = losses(sp2)
    assert sorted(full) == [1, 2, 3, 4, 5]  # 2 x 4 samples, then 3 x 8 (32 >= 28)
    sizes = [int(part.split(":")[1]) for line in sp2.stdout.splitlines()
             if "lm loss" in line for part in line.split("|") if "global batch size" in part]
    assert sizes == [4, 4, 8, 8, 8]
    assert losses(launch(1, *flags, run=run)) == pytest.approx(full, rel=2e-6)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert (ckpt / "iter_0000002").is_dir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = losses(launch(2, *flags, "--ulysses-sp-size", "2", "--load", str(ckpt),
                            run=run))
    assert sorted(resumed) == [3, 4, 5]
    assert resumed == pytest.approx({i: full[i] for i in (3, 4, 5)}, rel=2e-6)
