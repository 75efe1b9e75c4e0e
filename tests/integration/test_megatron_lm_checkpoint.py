"""Megatron-LM's torch_dist checkpoints (`training/megatron_lm_checkpoint.py`, `training/trust.py`).

The checkpoint is written as Megatron-LM's `save_checkpoint` writes one (its
`generate_state_dict`, checkpoint_version 3.0): megatron-core's `dist_checkpointing.save` of a
megatron-core GPTModel (local spec, on CPU) with `args` an argparse.Namespace of Megatron-LM's
field names (torch dtypes, AttnBackend, ModelType, the exit signal), numpy RNG states in the
`rng_state` ShardedObject, the rerun state machine's enums and ShardedObject, and its tracker.

- The keys are the TE spec's (`linear_qkv.layer_norm_weight`, ...); our layer spec loads them
  at SP 1 and SP 2 bitwise; iteration, consumed samples and the LR schedule come from it, the
  RNG states restart from --seed with one warning; --finetune starts at 0.
- Its optimizer state (here saved with --no-save-optim; a dp_reshardable distributed one) is
  one message naming --no-load-optim.
- `read_checkpoint_args` gives our args dict (renamed args mapped).
- A payload in its common.pt or in its rng_state ShardedObject is refused, naming the file.
- pretrain_gpt.py resumes it with --use-checkpoint-args at SP 1 and SP 2 with equal losses.
- A PP 2 x VPP 2 checkpoint (`model0`, `model1`: megatron-core GPTModels built per `vp_stage`
  on 2 gloo processes) loads every weight bitwise at PP 2 x VPP 2, PP 2 and PP 1; its legacy
  torch-format twin (`mp_rank_00_00x/model_optim_rng.pt`) is refused unread, naming Megatron-LM's
  conversion flags.
"""

import argparse
import contextlib
import io
import os
import pickle
import random
import shutil
import signal

import numpy as np
import pytest
import torch

from distributed import spawn
from launcher import pretrain

SAVED_AT, GBS, TRAIN_ITERS = 5, 4, 7
# The model of tests/integration/test_cli.py's MODEL (GQA, RoPE, RMSNorm, SwiGLU, no biases).
SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
             num_query_groups=2, kv_channels=8, seq_length=64, max_position_embeddings=64)
RUN = ["--micro-batch-size", "2", "--global-batch-size", str(GBS), "--lr", "1e-3",
       "--lr-warmup-iters", "2", "--log-interval", "1", "--num-workers", "0", "--mock-data",
       "--train-iters", str(TRAIN_ITERS), "--eval-iters", "0",
       "--attention-dropout", "0", "--hidden-dropout", "0", "--seq-length", "64",
       "--use-checkpoint-args"]
TE_SPEC_KEYS = ("decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                "decoder.layers.self_attention.linear_qkv.weight",
                "decoder.layers.self_attention.linear_proj.weight",
                "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight",
                "decoder.final_layernorm.weight", "embedding.word_embeddings.weight")


def megatron_lm_args(**overrides) -> argparse.Namespace:
    """What Megatron-LM's `args` holds for the model after validate_args and pretrain()
    (--mock-data: its NullTokenizer adds the eod token, 255 + 1 pads to 256)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    values = dict(
        SHAPE, group_query_attention=True, position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0,
        rotary_seq_len_interpolation_factor=None, rotary_scaling_factor=1.0, mscale=1.0,
        mscale_all_dim=0.0, yarn_original_max_position_embeddings=None, yarn_beta_fast=None,
        yarn_beta_slow=None, yarn_correction_range_round_to_int=None, normalization="RMSNorm", norm_epsilon=1e-5,
        swiglu=True, untie_embeddings_and_output_weights=False, add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=False, apply_layernorm_1p=False, squared_relu=False,
        rotary_interleaved=False, num_experts=None, attention_dropout=0.0, hidden_dropout=0.0,
        multi_latent_attention=False, mtp_num_layers=None,
        virtual_pipeline_model_parallel_size=None, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, vocab_size=255, padded_vocab_size=256,
        make_vocab_size_divisible_by=128, tokenizer_type="NullTokenizer", tokenizer_model=None,
        tiktoken_pattern=None, bf16=False, fp16=False,
        params_dtype=torch.float32, main_grads_dtype=torch.float32,
        use_distributed_optimizer=False, dist_ckpt_optim_fully_reshardable=False,
        no_save_optim=True, attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder, exit_signal=signal.SIGTERM,
        ckpt_format="torch_dist", micro_batch_size=2, global_batch_size=GBS, lr=1e-3,
        min_lr=0.0, train_iters=TRAIN_ITERS, lr_warmup_iters=2, weight_decay=0.01, seed=1234,
        consumed_train_samples=SAVED_AT * GBS, iteration=SAVED_AT)
    values.update(overrides)
    return argparse.Namespace(**values)


def _mcore_gpt(num_layers: int = 2, vp_stage=None, **layout):
    """A megatron-core GPTModel of SHAPE (but `num_layers`) with megatron-core's local spec
    (Megatron-LM's --transformer-impl local); `vp_stage` and `layout` (TransformerConfig's
    pipeline fields): the chunk of this pipeline rank's virtual stage, as Megatron-LM's
    get_model builds it."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_ulysses import cpu_compat

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
        num_query_groups=2, kv_channels=8, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, **layout)
    stage = {} if vp_stage is None else dict(
        vp_stage=vp_stage,
        pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
    with cpu_compat.tensors_stay_on_cpu():  # its tied output layer's all-reduce (PP > 1)
        return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                        vocab_size=256, max_sequence_length=64, position_embedding_type="rope",
                        share_embeddings_and_output_weights=True, **stage)


def _moved_off_init(model):
    """`model`, its weights moved off their initialization."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def _scheduler_state(model) -> dict:
    """megatron-core's OptimizerParamScheduler after SAVED_AT iterations, as Megatron-LM's
    get_optimizer_param_scheduler builds it for these args."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    scheduler = OptimizerParamScheduler(
        torch.optim.SGD(model.parameters(), lr=0.0), init_lr=0.0, max_lr=1e-3, min_lr=0.0,
        lr_warmup_steps=2 * GBS, lr_decay_steps=TRAIN_ITERS * GBS, lr_decay_style="linear",
        start_wd=0.01, end_wd=0.01, wd_incr_steps=TRAIN_ITERS * GBS, wd_incr_style="constant")
    for _ in range(SAVED_AT):
        scheduler.step(increment=GBS)
    return scheduler.state_dict()


def _rng_state() -> dict:
    """Megatron-LM's get_rng_state on one rank (its CUDA state: a CUDA generator's bytes)."""
    from megatron.core import tensor_parallel

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _save(rank, world, root, args, models: dict) -> None:
    """Megatron-LM's save_checkpoint at iteration SAVED_AT (TP 1, DP 1: every rank a pipeline
    stage) of `models` (its state key -> this rank's GPTModel), `args` its Namespace."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState

    rerun_sharded = {"rerun_requested": False, "checkpoint_requested": False,
                     "restart_again_requested": False, "continue_requested": False,
                     "error_injector_checkpoint": {
                         "error_injection_rate": 0,
                         "error_injection_type": RerunDiagnostic.TRANSIENT_ERROR,
                         "injected_error_type": None},
                     "failed_validation_call": None, "initial_result": None,
                     "suspicious_node": None, "suspicious_device": None,
                     "data_iterator_checkpoints": None, "large_value_counts": {},
                     "max_values": {}}
    pp_rank, pp = mpu.get_pipeline_model_parallel_rank(), \
        mpu.get_pipeline_model_parallel_world_size()
    state = {
        "args": args, "checkpoint_version": 3.0, "iteration": SAVED_AT,
        **{key: model.sharded_state_dict(metadata={"singleton_local_shards": False})
           for key, model in models.items()},
        "opt_param_scheduler": _scheduler_state(next(iter(models.values()))),
        "rerun_state_machine": {
            "mode": RerunMode.VALIDATE_RESULTS, "state": RerunState.NOT_RUNNING_YET,
            "current_iteration": SAVED_AT,
            "sharded": ShardedObject("rerun_state_machine_state", rerun_sharded, (world,),
                                     (rank,))},
        # one per (PP, TP) rank, replicated over DP
        "rng_state": ShardedObject("rng_state", [_rng_state()], (pp, 1), (pp_rank, 0),
                                   replica_id=0),
        "num_floating_point_operations_so_far": 1.5e9,
    }
    path = os.path.join(root, f"iter_{SAVED_AT:07d}")
    if rank == 0:
        os.makedirs(path)
    torch.distributed.barrier()
    dist_checkpointing.save(state, path)
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(SAVED_AT))


def _save_megatron_lm(rank, world, root, weights_file):
    """Megatron-LM's save_checkpoint at iteration SAVED_AT, TP 1 x PP 1 x DP 1."""
    from megatron.core import parallel_state as mpu

    from megatron_ulysses import cpu_compat

    cpu_compat.install()
    mpu.initialize_model_parallel()
    cpu_compat.model_parallel_manual_seed(1234)
    model = _moved_off_init(_mcore_gpt())
    torch.save({k: v for k, v in model.state_dict().items() if "_extra_state" not in k},
               weights_file)
    _save(rank, world, root, megatron_lm_args(), {"model": model})
    mpu.destroy_model_parallel()


def _save_legacy(root, args, chunks) -> None:
    """Megatron-LM's save_checkpoint with --ckpt-format torch: this pipeline rank's
    `mp_rank_00_<pp rank>/model_optim_rng.pt`, torch.save of its state dict (each chunk's
    `state_dict_for_save_checkpoint` as `model0`, `model1`, ...), and its tracker."""
    from megatron.core import parallel_state as mpu

    state = {"args": args, "checkpoint_version": 3.0, "iteration": SAVED_AT,
             **{f"model{i}": chunk.state_dict_for_save_checkpoint()
                for i, chunk in enumerate(chunks)},
             "opt_param_scheduler": _scheduler_state(chunks[0]), "rng_state": [_rng_state()],
             "num_floating_point_operations_so_far": 1.5e9}
    rank_dir = os.path.join(root, f"iter_{SAVED_AT:07d}",
                            f"mp_rank_00_{mpu.get_pipeline_model_parallel_rank():03d}")
    os.makedirs(rank_dir)
    torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(SAVED_AT))


def _save_megatron_lm_vpp(rank, world, root, legacy_root):
    """Megatron-LM's save_checkpoint of a PP 2 x VPP 2 run (4 layers, one per virtual stage):
    one GPTModel per virtual stage as its get_model builds them (megatron-core's `vp_stage`),
    saved as `model0`, `model1`; every weight `test_virtual_pipeline.weight` of its global
    name, so any layout can check what it loaded. The same in its legacy torch format at
    `legacy_root`."""
    from megatron.core import parallel_state as mpu
    from test_virtual_pipeline import set_weights

    from megatron_ulysses import cpu_compat

    cpu_compat.install()
    mpu.initialize_model_parallel(pipeline_model_parallel_size=2,
                                  virtual_pipeline_model_parallel_size=2)
    cpu_compat.model_parallel_manual_seed(1234)
    layout = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                  pipeline_dtype=torch.float32)
    chunks = [_mcore_gpt(4, vp_stage, **layout) for vp_stage in range(2)]
    set_weights(chunks)
    args = megatron_lm_args(num_layers=4, pipeline_model_parallel_size=2,
                            virtual_pipeline_model_parallel_size=2,
                            num_layers_per_virtual_pipeline_stage=1)
    _save(rank, world, root, args, {f"model{i}": chunk for i, chunk in enumerate(chunks)})
    _save_legacy(legacy_root, argparse.Namespace(**{**vars(args), "ckpt_format": "torch"}),
                 chunks)
    mpu.destroy_model_parallel()


@pytest.fixture(scope="module")
def megatron_lm_vpp(tmp_path_factory):
    """The roots of a PP 2 x VPP 2 Megatron-LM checkpoint: torch_dist, legacy torch
    (`_save_megatron_lm_vpp`)."""
    tmp = tmp_path_factory.mktemp("megatron_lm_vpp")
    spawn(_save_megatron_lm_vpp, 2, str(tmp / "ckpt"), str(tmp / "legacy"))
    return tmp / "ckpt", tmp / "legacy"


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    """(checkpoint root, file of its model weights)."""
    tmp = tmp_path_factory.mktemp("megatron_lm")
    root, weights = tmp / "ckpt", tmp / "weights.pt"
    spawn(_save_megatron_lm, 1, str(root), str(weights))
    return root, weights


def test_its_keys_are_the_te_spec_names_and_its_args_map_to_ours(megatron_lm):
    from megatron_ulysses.training.checkpoint.state import SAVED_ARGS
    from megatron_ulysses.training.checkpoint.load import read_checkpoint_args

    root, _ = megatron_lm
    with open(root / f"iter_{SAVED_AT:07d}" / ".metadata", "rb") as f:
        keys = set(pickle.load(f).state_dict_metadata)  # our own test file
    assert set(TE_SPEC_KEYS) <= keys
    saved = read_checkpoint_args(str(root))
    assert set(saved) == set(SAVED_ARGS)
    assert saved["num_query_groups"] == 2 and saved["disable_bias_linear"] is True
    assert {k: saved[k] for k in SHAPE if k != "seq_length"} == \
        {k: v for k, v in SHAPE.items() if k != "seq_length"}


def test_use_checkpoint_args_takes_its_tokenizer(sp_model, tmp_path, monkeypatch):
    """As Megatron-LM's load_args_from_checkpoint: its --tokenizer-type and --tokenizer-model
    over the command line's (here none)."""
    from megatron_ulysses.training.arguments import parse_args
    from megatron_ulysses.training.checkpoint import load as checkpoint_load
    from megatron_ulysses.training.checkpoint import state as checkpoint_state
    from megatron_ulysses.training.checkpoint.megatron_lm import common_state

    args = megatron_lm_args(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp_model,
                            vocab_size=None, padded_vocab_size=1024)
    saved = common_state("ckpt", {"args": args, "checkpoint_version": 3.0, "iteration": 5},
                         checkpoint_state.SAVED_ARGS, checkpoint_state.OPTIMIZER_METADATA)["args"]
    monkeypatch.setattr(checkpoint_load, "read_checkpoint_args", lambda root: saved)
    data = parse_args(RUN + ["--load", str(tmp_path)], world_size=1).data
    assert (data.tokenizer_type, data.tokenizer_model, data.vocab_size) == \
        ("GPTSentencePieceTokenizer", sp_model, None)


def test_its_optimizer_state_needs_no_load_optim_unless_its_layout_is_ours(tmp_path):
    from megatron_ulysses.training.checkpoint.state import SAVED_ARGS, OPTIMIZER_METADATA
    from megatron_ulysses.training.checkpoint.megatron_lm import common_state

    def refusal(**args):
        common = {"args": megatron_lm_args(**args), "checkpoint_version": 3.0, "iteration": 5}
        return common_state("ckpt", common, SAVED_ARGS, OPTIMIZER_METADATA)["optimizer_refusal"]

    assert "--no-save-optim" in refusal()
    assert "dp_reshardable" in refusal(no_save_optim=False, use_distributed_optimizer=True)
    assert refusal(no_save_optim=False, use_distributed_optimizer=True,
                   dist_ckpt_optim_fully_reshardable=True) is None
    assert refusal(no_save_optim=False) is None
    from megatron_ulysses.errors import ConfigError

    with pytest.raises(ConfigError, match=r"does not build \(--num-experts\)"):
        common_state("ckpt", {"args": megatron_lm_args(num_experts=8), "checkpoint_version": 3.0},
                     SAVED_ARGS, OPTIMIZER_METADATA)


class Payload:
    """Unpickling it runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("where", ["common.pt", "rng_state ShardedObject"])
def test_a_payload_in_its_common_state_or_rng_state_is_refused(megatron_lm, tmp_path, where):
    from test_checkpointing import _blob, _plant_bytes_item

    from megatron_ulysses.errors import ConfigError
    from megatron_ulysses.training.checkpoint.load import read_common_state

    root = tmp_path / "evil"
    shutil.copytree(megatron_lm[0], root)
    ckpt, marker = root / f"iter_{SAVED_AT:07d}", tmp_path / "marker"
    if where == "common.pt":
        offending = str(ckpt / "common.pt")
        common = torch.load(offending, weights_only=False)  # our own test file
        common["args"].tokenizer_model = Payload(marker)
        torch.save(common, offending)
    else:
        rng = [{"np_rng_state": np.random.get_state(), "evil": Payload(marker)}]
        offending = _plant_bytes_item(str(ckpt), "rng_state/shard_0.0_1.1", _blob(rng))
    with pytest.raises(ConfigError) as error:
        read_common_state(str(root))
    assert str(error.value).startswith(f"--load {ckpt}: refusing to load {offending}")
    assert "it holds a pickled posix.system" in str(error.value)
    assert not marker.exists()


def _load_cases(rank, world, root, weights_file, sp):
    from megatron_ulysses.sp import parallel_state as ps
    from megatron_ulysses.errors import ConfigError
    from megatron_ulysses.training.checkpoint.load import load_checkpoint
    from test_checkpointing import build_run

    saved = torch.load(weights_file, weights_only=True)
    for extra, expected in (([], "--no-load-optim"), (["--no-load-optim"], (SAVED_AT, 20)),
                            (["--finetune"], (0, 0))):
        config, model, optimizer, scheduler = build_run(
            RUN + ["--load", root, "--ulysses-sp-size", str(sp)] + extra, world)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                result = load_checkpoint(root, model, optimizer, scheduler, config)
        except ConfigError as error:
            assert isinstance(expected, str) and expected in str(error), str(error)
            assert "saved without optimizer state (--no-save-optim)" in str(error)
        else:
            assert result == expected
            params = {k: v for k, v in model.module.state_dict().items()
                      if "_extra_state" not in k}
            assert params.keys() == saved.keys()
            for name, param in params.items():
                assert torch.equal(param.detach(), saved[name]), name
            if extra == ["--no-load-optim"] and rank == 0:
                assert "saved by Megatron-LM" in printed.getvalue()
                assert "seeded from --seed 1234" in printed.getvalue()
        ps.destroy_model_parallel()


@pytest.mark.parametrize("world, sp", [(1, 1), (2, 2)])
def test_it_loads_bitwise_at_sp_1_and_2_and_finetunes(megatron_lm, world, sp):
    root, weights = megatron_lm
    spawn(_load_cases, world, str(root), str(weights), sp)


VPP_LAYOUTS = {  # world size -> the layouts our run loads the PP 2 x VPP 2 checkpoint at
    1: [[]],
    2: [["--num-layers-per-virtual-pipeline-stage", "1"], []],
}


def _load_vpp_cases(rank, world, root):
    """Each of `VPP_LAYOUTS[world]` loads every weight of its chunks bitwise: the saver's
    `weight` of the parameter's global name (its layer's global number; the tied output layer
    as the embedding)."""
    from test_checkpointing import build_run
    from test_virtual_pipeline import global_name, weight

    from megatron_ulysses.sp import parallel_state as ps
    from megatron_ulysses.training.checkpoint.load import load_checkpoint
    from megatron_ulysses.training.chunks import model_chunks

    for layout in VPP_LAYOUTS[world]:
        # --use-checkpoint-args takes its shape, not its pipeline size (as Megatron-LM)
        pp = ["--pipeline-model-parallel-size", str(world)] if world > 1 else []
        argv = RUN + ["--load", root, "--no-load-optim"] + pp + layout
        config, model, optimizer, scheduler = build_run(argv, world)
        assert len(model_chunks(model)) == (2 if layout else 1)
        assert load_checkpoint(root, model, optimizer, scheduler, config) == (SAVED_AT, 20)
        for chunk in model_chunks(model):
            for name, param in chunk.module.named_parameters():
                expected = weight(global_name(chunk.module, name), param.shape)
                assert torch.equal(param.detach(), expected), (layout, name)
        ps.destroy_model_parallel()


def test_its_virtual_pipeline_checkpoint_loads_bitwise_at_any_pipeline_layout(
        megatron_lm_vpp):
    """Megatron-LM's PP 2 x VPP 2 checkpoint (`model0`, `model1`) at PP 2 x VPP 2, PP 2 and
    PP 1: megatron-core's keys are the whole model's, whatever the chunks."""
    for world in VPP_LAYOUTS:
        spawn(_load_vpp_cases, world, str(megatron_lm_vpp[0]))


def test_its_legacy_torch_format_is_refused_unread_naming_the_conversion(megatron_lm_vpp,
                                                                          tmp_path):
    """--ckpt-format torch's mp_rank_*/model_optim_rng.pt: one message naming Megatron-LM's
    --ckpt-convert-format, before any file is unpickled (a payload in one stays asleep)."""
    from megatron_ulysses.errors import ConfigError
    from megatron_ulysses.training.checkpoint.load import read_common_state

    root = tmp_path / "legacy"
    shutil.copytree(megatron_lm_vpp[1], root)
    marker = tmp_path / "marker"
    torch.save({"args": Payload(marker)},
               root / f"iter_{SAVED_AT:07d}" / "mp_rank_00_001" / "model_optim_rng.pt")
    for checkpoint in (megatron_lm_vpp[1], root):
        with pytest.raises(ConfigError) as error:
            read_common_state(str(checkpoint))
        assert str(error.value).startswith(
            f"--load {checkpoint / f'iter_{SAVED_AT:07d}'} is a Megatron-LM checkpoint in its "
            "legacy torch format (2 mp_rank_*/model_optim_rng.pt files)")
        assert f"--ckpt-format torch --load {checkpoint} --ckpt-convert-format torch_dist" \
            in str(error.value)
    assert not marker.exists()


def test_pretrain_gpt_resumes_it_at_sp_1_and_2_with_equal_losses(megatron_lm):
    from test_cli import losses

    def run(*flags):
        return losses(pretrain(2, [*RUN, "--load", str(megatron_lm[0]), "--no-load-optim",
                                   *flags]))

    sp1, sp2 = run(), run("--ulysses-sp-size", "2")
    assert sorted(sp1) == list(range(SAVED_AT + 1, TRAIN_ITERS + 1))
    assert sp2 == pytest.approx(sp1, rel=2e-6)
