"""The logging flags (Megatron-LM's meanings): one short pretrain_gpt.py run writes the params
norm, the zero-gradient count, megatron-core's timers, memory, world size and validation
perplexity to TensorBoard (and W&B, offline, where wandb is installed) and progress.txt to
--save; in-process: the zero count and the params norm equal their definitions; bad W&B flags are
one message each."""

import importlib.util
import math
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from conftest import REPO_ROOT
from distributed import spawn
from test_cli import ITERATION, MODEL, RUN, VALIDATION

from megatron_ulysses.training.arguments import ConfigError, parse_args

FLAGS = ["--log-params-norm", "--log-num-zeros-in-grad", "--timing-log-level", "2",
         "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-memory-interval",
         "2", "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
         "--logging-level", "20", "--log-progress"]
HAS_WANDB = importlib.util.find_spec("wandb") is not None


def _scalars(path) -> dict:
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(str(path), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def test_logging_flags_write_what_megatron_lm_writes(tmp_path):
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    wandb = ["--wandb-project", "p", "--wandb-exp-name", "tiny"] if HAS_WANDB else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *MODEL, *RUN, "--mock-data",
         "--vocab-size", "256", "--train-iters", "4", "--eval-iters", "1", "--eval-interval",
         "2", "--save", str(ckpt), "--save-interval", "2", "--tensorboard-dir", str(tb),
         *FLAGS, *wandb], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert [int(i) for i, _ in ITERATION.findall(result.stdout)] == [1, 2, 3, 4]
    assert "num zeros: " in result.stdout and "params norm: " in result.stdout
    assert "forward-backward ...." in out and "backward-compute ...." in out
    assert "(after 2 iterations) memory:" in result.stdout
    scalars = _scalars(tb)
    for tag in ("params-norm", "num-zeros", "world-size", "iteration-time",
                "forward-backward-time", "optimizer-time", "forward-compute-time",
                "mem-rss-bytes", "validation/lm loss ppl"):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
    validation = {int(i): float(v) for i, v in VALIDATION.findall(result.stdout)}
    for step, loss in validation.items():
        assert scalars["validation/lm loss ppl"][step] == pytest.approx(math.exp(loss),
                                                                       rel=1e-5)
    assert scalars["world-size"][4] == 1
    assert scalars["params-norm"][4] > 0 and 0 <= scalars["num-zeros"][4] < 1e6
    progress = (ckpt / "progress.txt").read_text().splitlines()
    assert progress[0].endswith("Starting job")
    assert ["Iteration: 2" in progress[1], "Iteration: 4" in progress[2]] == [True, True]
    if HAS_WANDB:
        runs = list((ckpt / "wandb").rglob("*.wandb"))
        assert runs, f"no offline W&B run under {ckpt / 'wandb'}"


def _norm_and_zeros(rank, world):
    from test_checkpointing import _build, _teardown

    from megatron_ulysses.training.logging import params_l2_norm
    from megatron_ulysses.training.optimizer import build_optimizer

    config, model, _, _ = _build(world)
    try:
        expected = torch.cat([p.detach().double().flatten() for p in model.parameters()]).norm()
        assert params_l2_norm(model) == pytest.approx(expected.item(), rel=1e-9)
        optimizer = build_optimizer(config.optimizer, config.model, model,
                                    log_num_zeros_in_grad=True)
        zeros = 0
        for index, param in enumerate(model.parameters()):
            param.main_grad = torch.ones_like(param)
            if index % 2:
                param.main_grad.view(-1)[: param.numel() // 2] = 0
                zeros += param.numel() // 2
        assert optimizer.step()[2] == zeros
    finally:
        _teardown()


def test_params_norm_and_zero_gradients_are_their_definitions():
    spawn(_norm_and_zeros, 1)


ARGS = MODEL + RUN + ["--mock-data", "--vocab-size", "256", "--train-iters", "4"]


@pytest.mark.parametrize("flags, message", [
    (["--wandb-project", "p", "--wandb-exp-name", ""], "--wandb-exp-name"),
    (["--log-interval", "2", "--log-memory-interval", "3"],
     "--log-memory-interval 3 must be a multiple of --log-interval 2"),
])
def test_bad_logging_flags_name_the_flag(flags, message, tmp_path):
    with mock.patch("importlib.util.find_spec", return_value=object()):
        with pytest.raises(ConfigError, match=message):
            parse_args(ARGS + ["--save", str(tmp_path)] + flags, world_size=1)


def test_wandb_missing_names_the_flag_and_the_extra(tmp_path):
    real = importlib.util.find_spec
    with mock.patch("importlib.util.find_spec",
                    side_effect=lambda name, *a: None if name == "wandb" else real(name, *a)):
        with pytest.raises(ConfigError, match=r"--wandb-project.*megatron_ulysses\[wandb\]"):
            parse_args(ARGS + ["--save", str(tmp_path), "--wandb-project", "p",
                               "--wandb-exp-name", "x"], world_size=1)
