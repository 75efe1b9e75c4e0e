"""Sharded data parallelism on ONE GPU: pretrain_gpt.py jobs whose ranks share GPU 0 over gloo
(as tests/gpu/test_trainer_sp.py), bf16 with Transformer Engine, against DDP at SP 1.

- Megatron-FSDP (`--use-megatron-fsdp`, megatron-core's FullyShardedDataParallel and its
  distributed optimizer) at SP 2 with each --data-parallel-sharding-strategy but optim, and
  optim_grads_params at DP 2 x SP 2, log SP 1's losses (LOSS_REL, as test_trainer_sp.py). Its
  CUDA side streams and buffers keep it off the CPU; tests/integration/test_fsdp.py covers torch FSDP2 there.
  The optim strategy measured wrong on an H100 (its first grad norm 1.5x DDP's, at DP 2 without
  SP too): refused on GPU (tests/unit/test_perf_flags.py), not run here.
- Either FSDP at DP 2 x SP 2 with TiledMLP, tiled loss, full recompute and activation offload
  logs SP 1's losses. Measured 19% (Megatron-FSDP) and 4% (FSDP2) off before the tiles handed
  each parameter's gradient to autograd once (memory/tiling.py) and FSDP2 kept the output layer
  in its root unit under tiled loss (training/fsdp.py).
- Each rank's measured bytes (its Megatron-FSDP buffers, the Adam moments) of a term the strategy
  shards are the no_shard run's / (DP x SP), up to the buffers' padding (PAD_REL); the other
  terms equal no_shard's.
- torch FSDP2 (`--use-torch-fsdp2`) at SP 2 and DP 2 x SP 2 logs SP 1's losses,
  and exactly 1/(DP x SP) of SP 1's bf16 parameter and gradient bytes and of fp32 Adam moments;
  its SP 2 checkpoint resumes at DP 2 x SP 2 and at SP 1 under DDP.

Run as the lead runs the GPU suite: `python -m pytest -q tests/gpu/test_fsdp_gpu.py` on the GPU
machine (tests/gpu/run.sh runs it with the rest). This file is also the torchrun launcher of its
jobs (`__main__` below): it wraps tests/gpu/gloo_launcher.py with what Megatron-FSDP needs on
gloo, so the package is never patched.
"""

import contextlib
import os
import re
import sys
from pathlib import Path

import pytest
from test_trainer import REPO, Run, report
from test_trainer_sp import _view, _wave

HERE = str(Path(__file__).resolve())
ITERS, HALF = 6, 3
LOSS_REL, PAD_REL = 2e-3, 0.02
MODEL = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
         "--ffn-hidden-size", "1536", "--group-query-attention", "--num-query-groups", "2",
         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--seq-length", "1024"]
MEMORY = ["--tiled-mlp-shards", "2", "--tiled-loss-shards", "3", "--recompute-granularity",
          "full", "--recompute-method", "uniform", "--offload-activations"]
RUN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
       "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--train-iters", str(ITERS),
       "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
       "--distributed-backend", "gloo", "--bf16", "--no-gradient-accumulation-fusion",
       "--mock-data", "--vocab-size", "2048"]
STRATEGIES = ("no_shard", "optim_grads", "optim_grads_params")
BYTES = re.compile(r"> rank (\d+) bytes \((\w+): [^)]*= (\d+)\): parameters (\d+) \| "
                   r"gradients (\d+) \| optimizer state (\d+)")
PARAMETERS = re.compile(r"parameters on rank 0: ([\d,]+)")
TERMS = ("parameters", "gradients", "optimizer state")


def _megatron_fsdp(strategy):
    return ["--use-megatron-fsdp", "--use-distributed-optimizer",
            "--data-parallel-sharding-strategy", strategy]


def _job(name, workdir, world, sp, flags):
    program = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}", HERE, str(REPO / "pretrain_gpt.py")]
    return Run(name, [*MODEL, *RUN, *flags, "--ulysses-sp-size", str(sp)], workdir,
               program=program)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("fsdp_runs")
    save = ["--save", str(work / "fsdp2_sp2" / "ckpt"), "--save-interval", str(HALF)]
    done = _wave([
        _job("ddp_sp1", work, 1, 1, ["--use-distributed-optimizer"]),
        *[_job(f"mfsdp_{s}_sp2", work, 2, 2, _megatron_fsdp(s)) for s in STRATEGIES],
        _job("mfsdp_dp2_sp2", work, 4, 2, _megatron_fsdp("optim_grads_params")),
        _job("fsdp2_sp2", work, 2, 2, ["--use-torch-fsdp2", *save]),
        _job("fsdp2_dp2_sp2", work, 4, 2, ["--use-torch-fsdp2"]),
        _job("mfsdp_memory_dp2_sp2", work, 4, 2, _megatron_fsdp("optim_grads_params") + MEMORY),
        _job("fsdp2_memory_dp2_sp2", work, 4, 2, ["--use-torch-fsdp2", *MEMORY]),
    ])
    load = ["--load", _view(work / "fsdp2_sp2" / "ckpt", HALF, work / "fsdp2_at_half")]
    done.update(_wave([
        _job("fsdp2_resumed_dp2_sp2", work, 4, 2, ["--use-torch-fsdp2", *load]),
        # DDP without the distributed optimizer: FSDP2's optimizer is the same kind (the
        # checkpoint's optimizer flags must match the run's)
        _job("fsdp2_resumed_ddp_sp1", work, 1, 1, load),
    ]))
    return done


def _close(got, expected, name, iterations=range(1, ITERS + 1)):
    expected = {i: expected[i] for i in iterations}
    assert got.keys() == expected.keys(), (name, got, expected)
    worst = max(abs(got[i] - expected[i]) / abs(expected[i]) for i in expected)
    report(name, worst_rel=worst)
    assert got == pytest.approx(expected, rel=LOSS_REL), name


def _bytes(run) -> dict:
    """rank -> (strategy, shards, {term: bytes}) from the run's log."""
    return {int(rank): (strategy, int(shards), dict(zip(TERMS, map(int, rest))))
            for rank, strategy, shards, *rest in BYTES.findall(run.output)}


@pytest.mark.parametrize("name", [f"mfsdp_{s}_sp2" for s in STRATEGIES]
                         + ["mfsdp_dp2_sp2", "fsdp2_sp2", "fsdp2_dp2_sp2",
                            "mfsdp_memory_dp2_sp2", "fsdp2_memory_dp2_sp2"])
def test_sharded_runs_log_ddps_losses(runs, name):
    _close(runs[name].check().losses, runs["ddp_sp1"].check().losses, name)


def test_fsdp2_checkpoint_resumes_at_another_dp_x_sp(runs):
    expected = runs["ddp_sp1"].check().losses
    for name in ("fsdp2_resumed_dp2_sp2", "fsdp2_resumed_ddp_sp1"):
        run = runs[name].check()
        assert "loaded checkpoint" in run.output, name
        _close(run.losses, expected, name, range(HALF + 1, ITERS + 1))


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_megatron_fsdp_shards_what_its_strategy_says(runs, strategy):
    from megatron_ulysses.training.fsdp import SHARDED_TERMS

    full = _bytes(runs["mfsdp_no_shard_sp2"].check())[0][2]
    measured = _bytes(runs[f"mfsdp_{strategy}_sp2"].check())
    assert sorted(measured) == [0, 1]
    report(f"mfsdp_{strategy}_bytes", full=full, measured=measured[0][2])
    for rank, (logged, shards, got) in measured.items():
        assert (logged, shards) == (strategy, 2)
        for term in TERMS:
            want = full[term] / 2 if term in SHARDED_TERMS[strategy] else full[term]
            assert got[term] == pytest.approx(want, rel=PAD_REL), (rank, term, got, full)


@pytest.mark.parametrize("name, shards", [("fsdp2_sp2", 2), ("fsdp2_dp2_sp2", 4)])
def test_fsdp2_holds_one_over_dp_x_sp_of_everything(runs, name, shards):
    parameters = int(PARAMETERS.search(runs["ddp_sp1"].check().output).group(1)
                     .replace(",", ""))
    measured = _bytes(runs[name].check())
    assert sorted(measured) == list(range(shards))
    want = {"parameters": 2 * parameters // shards, "gradients": 2 * parameters // shards,
            "optimizer state": 8 * parameters // shards}  # bf16 weights and grads, fp32 Adam
    for rank, (strategy, group, got) in measured.items():
        assert (strategy, group, got) == ("optim_grads_params", shards, want), rank


@contextlib.contextmanager
def _synchronous(group=None, device=None, async_ops=False):
    """Megatron-FSDP's `_coalescing_manager` on gloo (which has none): the collectives issued
    inside run one by one, each synchronously even when asked for asynchronously, and the
    handle the caller waits on is already finished."""
    import torch.distributed as dist
    from gloo_launcher import _Finished

    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
    originals = {name: getattr(dist, name) for name in names}

    def blocking(collective):
        def call(*args, async_op=False, **kwargs):
            collective(*args, **kwargs)
            return _Finished()
        return call

    for name in names:
        setattr(dist, name, blocking(originals[name]))
    try:
        yield _Finished()
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)


def _launch() -> None:
    """torchrun entry: Megatron-FSDP's buffers on gloo, then tests/gpu/gloo_launcher.py."""
    import gloo_launcher
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer

    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # Megatron-FSDP refuses 1 (test_trainer)
    param_and_grad_buffer._coalescing_manager = _synchronous
    gloo_launcher.main()


if __name__ == "__main__":
    _launch()
