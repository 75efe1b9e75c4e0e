"""Megatron-LM flags of the parser, parallelism, model and data sections: each does
what Megatron-LM's does (checked on the config or the built piece), or is refused by name."""

import contextlib
import dataclasses
import io
import json
from unittest import mock

import pytest
import torch
from megatron.core.activations import squared_relu

from distributed import spawn
from megatron_ulysses import cpu_compat
from megatron_ulysses.sp import rng
from megatron_ulysses.sp import parallel_state as ps
from megatron_ulysses.data.datasets import build_train_valid_test_datasets
from megatron_ulysses.data.tokenizers import build_tokenizer
from megatron_ulysses.sp.layer_specs import ZeroCenteredNorm
from megatron_ulysses.training import model as model_builders
from megatron_ulysses.training.arguments import ConfigError, parse_args
from megatron_ulysses.training.config.megatron_lm import compat
from megatron_ulysses.training.config.megatron_lm.compat import IGNORED
from megatron_ulysses.training.config.megatron_lm.refused import NOT_BUILT, OUT_OF_SCOPE
from megatron_ulysses.data.vocab import model_vocab_size

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test

DATA_RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
            "--seq-length", "32", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters",
            "2", "--num-workers", "0", "--eval-iters", "0"]
BASE = DATA_RUN + ["--mock-data", "--vocab-size", "64"]
YARN = ["--position-embedding-type", "yarn"]


def problem(argv, world_size=1) -> str:
    """The one message parsing `argv` stops with ('' if it does not); exit status 2."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse_args(argv, world_size=world_size)
    except ConfigError as error:
        return str(error)
    except SystemExit as exit_:
        assert exit_.code == 2
        return stderr.getvalue()
    return ""


def test_one_problem_keeps_argparse_wording_and_suggests_the_flag():
    said = problem(BASE + ["--hidden-sise", "64"])
    assert said.count("\n") == 1 and "error: unrecognized arguments: --hidden-sise 64 " \
        "(did you mean --hidden-size" in said, said
    said = problem(BASE + ["--lr-decay-style", "cosin"])
    assert said.count("\n") == 1 and "invalid choice: 'cosin'" in said, said


def test_missing_required_flags_come_with_the_other_problems():
    said = problem(["--hidden-size", "x", "--lr", "1e-3", "--train-iters", "2", "--mock-data"])
    assert "2 problems" in said and "invalid int value: 'x'" in said, said
    assert "required: --num-layers, --num-attention-heads, --seq-length" in said, said


@pytest.mark.parametrize("group, _, prefixes, names", OUT_OF_SCOPE,
                         ids=[group[0] for group in OUT_OF_SCOPE])
def test_every_out_of_scope_group_names_each_flag_and_why(group, _, prefixes, names):
    flags = [prefix + "x" for prefix in prefixes if prefix.endswith("-")] + list(names)[:2]
    said = problem(BASE + [word for flag in flags for word in (flag, "1")])
    assert said.count("\n") == 1 and "unrecognized" not in said, said
    assert f"{group} (" in said and all(flag in said for flag in flags), said


@pytest.mark.parametrize("argv, words", [
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a"],
     ["--context-parallel-size 4", "--ulysses-sp-size 4", "a2a"]),
    (["--hierarchical-context-parallel-sizes", "2", "2"],
     ["--hierarchical-context-parallel-sizes 2 2", "multiply to --context-parallel-size (1)"]),
    (["--cp-comm-type", "a2a+p2p"], ["--hierarchical-context-parallel-sizes"]),
    (["--cp-comm-type", "ring"], ["--cp-comm-type", "invalid choice: 'ring'"]),
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     ["--num-layers-per-virtual-pipeline-stage", "--pipeline-model-parallel-size > 1"]),
    (["--num-distributed-optimizer-instances", "2"],
     ["--num-distributed-optimizer-instances", "CUDA"]),
    (["--squared-relu", "--swiglu"], ["--squared-relu and --swiglu"]),
    (YARN + ["--rotary-interleaved"], ["--position-embedding-type yarn rotates halves",
                                       "drop --rotary-interleaved"]),
    (YARN + ["--rotary-percent", "0.5"], ["ignores --rotary-percent 0.5"]),
    (YARN + ["--use-rope-scaling"], ["--use-rope-scaling: another RoPE scaling"]),
    (YARN + ["--rotary-scaling-factor", "0"], ["--rotary-scaling-factor must be positive"]),
    (YARN + ["--yarn-beta-fast", "-1"], ["--yarn-beta-fast must be positive, got -1"]),
    (YARN + ["--rotary-scaling-factor", "4", "--mscale-all-dim", "-10"],
     ["0.1 x --mscale-all-dim (-10.0) x ln(--rotary-scaling-factor 4.0)", "must be positive"]),
    (["--recompute-activations", "--recompute-granularity", "full",
      "--recompute-method", "block"], ["--recompute-activations", "full"]),
    (["--te-rng-tracker"], ["--te-rng-tracker", "CUDA"]),
    (["--padded-vocab-size", "0"], ["--padded-vocab-size must be >= 1"]),
    # Megatron-LM's flag is named, not only the --ulysses-attention-backend te it implies (on
    # CPU: TE missing or no CUDA; on a GPU with TE: --transformer-impl local)
    (["--attention-backend", "unfused", "--transformer-impl", "local"],
     ["--attention-backend unfused runs --ulysses-attention-backend te here",
      "--ulysses-attention-backend te"]),
])
def test_bad_combinations_are_one_message_naming_the_flag(argv, words):
    said = problem(BASE + argv)
    for word in words:
        assert word in said, said


_ITERS = BASE.index("--train-iters")
NO_ITERS = BASE[:_ITERS] + BASE[_ITERS + 2:]
PP2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]
VIRTUAL = ("a virtual pipeline, --num-layers-per-virtual-pipeline-stage or "
           "--num-virtual-stages-per-pipeline-rank")


@pytest.mark.parametrize("context, options, feature, world_size", [
    ([], ["--recompute-modules", "mlp"], "--recompute-granularity selective", 1),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"],
     ["--recompute-modules", "core_attn"], "--recompute-granularity selective", 1),
    ([], ["--mup-base-hidden-size", "32"], "--use-mup", 1),
    (["--position-embedding-type", "learned_absolute"],
     ["--use-rope-scaling", "--rotary-interleaved"], "--position-embedding-type rope", 1),
    (["--position-embedding-type", "none"], ["--rotary-seq-len-interpolation-factor", "2"],
     "--position-embedding-type rope", 1),
    (["--position-embedding-type", "rope"], ["--rotary-scaling-factor", "4", "--mscale", "0.5",
                                             "--no-yarn-correction-range-round-to-int"],
     "--position-embedding-type yarn", 1),
    ([], ["--microbatch-group-size-per-virtual-pipeline-stage", "2"], VIRTUAL, 1),
    (PP2, ["--microbatch-group-size-per-virtual-pipeline-stage", "2"], VIRTUAL, 2),
    ([], ["--finetune", "--exit-on-missing-checkpoint"], "--load", 1),
    ([], ["--use-mp-args-from-checkpoint-args", "--no-use-tokenizer-model-from-checkpoint-args"],
     "--use-checkpoint-args", 1),
    ([], ["--lr-wsd-decay-samples", "8"], "--train-samples", 1),
    (["--train-samples", "8"], ["--lr-wsd-decay-iters", "2"],
     "--train-iters", 1),
])
def test_options_of_a_feature_that_is_off_are_ignored_as_in_megatron_lm(
        context, options, feature, world_size):
    """Megatron-LM reads them only with the feature: said once naming each and the feature,
    and the run is the one without them (the GPU sections' are in test_perf_flags.py)."""
    from test_perf_flags import assert_ignored

    base = NO_ITERS if "--train-samples" in context else BASE
    assert_ignored(parse_args(base + context + options, world_size=world_size),
                   parse_args(base + context, world_size=world_size), options, feature)


def test_context_parallel_1_flags_are_accepted():
    config = parse_args(BASE + ["--context-parallel-size", "1", "--cp-comm-type", "p2p",
                                "--hierarchical-context-parallel-sizes", "1",
                                "--disable-gloo-process-groups", "--use-tp-pp-dp-mapping"],
                        world_size=1)
    assert not config.model.use_gloo_process_groups
    assert config.dims.order == ps.TP_PP_DP_ORDER


def test_tp_pp_dp_mapping_keeps_sp_groups_consecutive_and_dp_across_stages():
    dims = ps.ParallelDims(world_size=8, tp=1, pp=2, sp=2, order=ps.TP_PP_DP_ORDER)
    assert dims.rank_groups("sp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # pipeline stages: ranks {0, 1, 4, 5} and {2, 3, 6, 7}; DP pairs the outer blocks
    assert dims.rank_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_model_flags_reach_megatron_cores_config():
    config = parse_args(BASE + ["--squared-relu", "--apply-layernorm-1p",
                                "--init-method-xavier-uniform", "--test-mode",
                                "--position-embedding-type", "rope", "--rotary-interleaved",
                                "--recompute-activations", "--apply-query-key-layer-scaling",
                                "--no-persist-layer-norm", "--use-cpu-initialization"],
                        world_size=1)
    mcore = model_builders.transformer_config(config.model, config.dims)
    assert mcore.activation_func is squared_relu and not mcore.bias_activation_fusion
    assert mcore.layernorm_zero_centered_gamma and mcore.rotary_interleaved and mcore.test_mode
    assert mcore.init_method is torch.nn.init.xavier_uniform_
    assert mcore.output_layer_init_method is torch.nn.init.xavier_uniform_
    assert mcore.recompute_granularity == "selective"
    # on GPU the weights are made on the GPU unless --use-cpu-initialization (CPU: always)
    assert model_builders.transformer_config_kwargs(config.model, config.dims, True)[
        "use_cpu_initialization"]
    default = parse_args(BASE, world_size=1)
    assert not model_builders.transformer_config_kwargs(default.model, default.dims, True)[
        "use_cpu_initialization"]


@pytest.mark.parametrize("rms", [False, True])
def test_zero_centered_norm_starts_as_the_plain_norm_and_scales_by_one_plus_w(rms):
    torch.manual_seed(0)
    x = torch.randn(5, 2, 16)
    norm = ZeroCenteredNorm(16, 1e-5, rms=rms)
    plain = torch.nn.RMSNorm(16, eps=1e-5) if rms else torch.nn.LayerNorm(16, eps=1e-5)
    assert torch.equal(norm.weight, torch.zeros(16))
    torch.testing.assert_close(norm(x), plain(x))
    with torch.no_grad():
        norm.weight.normal_()
        plain.weight.copy_(1 + norm.weight)
    torch.testing.assert_close(norm(x), plain(x))


@contextlib.contextmanager
def _built_model(flags):
    """The GPT model of BASE + `flags` on this one process (vocab padded to 128)."""
    config = parse_args(BASE + flags, world_size=1)
    cpu_compat.install()
    ps.initialize_model_parallel(dims=config.dims)
    rng.seed_dropout_streams(1)
    try:
        config = config.with_padded_vocab_size(128)
        mcore = model_builders.transformer_config(config.model, config.dims)
        yield model_builders.build_model(config.model, config.optimizer, 1, mcore)
    finally:
        ps.destroy_model_parallel()


def _build_layernorm_1p_model(rank, world_size):
    with _built_model(["--apply-layernorm-1p", "--qk-layernorm", "--squared-relu",
                       "--normalization", "RMSNorm"]) as model:
        norms = {name: p for name, p in model.named_parameters() if "norm" in name}
        # input / pre-MLP / q / k norms of 2 layers and the final norm: gamma - 1 = 0
        assert len(norms) == 2 * 4 + 1, sorted(norms)
        assert all(torch.equal(p, torch.zeros_like(p)) for p in norms.values())
        logits = model(torch.randint(0, 64, (1, 32)), torch.arange(32)[None], None)
        assert torch.isfinite(logits).all()


def test_layernorm_1p_builds_zero_centered_norms_in_the_local_spec():
    spawn(_build_layernorm_1p_model, 1)


YARN_FLAGS = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
              "--yarn-original-max-position-embeddings", "8", "--mscale", "0.8",
              "--no-yarn-correction-range-round-to-int"]


def _build_yarn_model(rank, world_size):
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding

    from megatron_ulysses.sp.rope import ShardedRotaryEmbedding

    with _built_model(YARN_FLAGS) as model:
        rotary = model.module.rotary_pos_emb
        assert isinstance(rotary, ShardedRotaryEmbedding)
        yarn = rotary.rotary
        assert isinstance(yarn, YarnRotaryEmbedding)
        assert (yarn.scaling_factor, yarn.original_max_position_embeddings, yarn.mscale,
                yarn.correction_range_round_to_int) == (4.0, 8, 0.8, False)
        with mock.patch.object(ps, "get_ulysses_sp_rank", return_value=1):
            shard, factor = rotary(16)  # SP rank 1 of 2 at 32 tokens: positions 16 .. 31
        whole, whole_factor = yarn(32)
        assert factor == whole_factor != 1.0 and torch.equal(shard, whole[16:])
        logits = model(torch.randint(0, 64, (1, 32)), torch.arange(32)[None], None)
        assert torch.isfinite(logits).all()


def test_yarn_flags_reach_megatron_cores_yarn_embedding_at_global_positions():
    """Megatron-LM's YaRN flags, unset ones at its defaults, on the TransformerConfig and in the
    `YarnRotaryEmbedding` megatron-core's GPTModel builds, which `ShardedRotaryEmbedding`
    shifts to each SP rank's positions; saved with the checkpoint's model args."""
    from megatron_ulysses.sp.rope import YARN_CONFIG
    from megatron_ulysses.training.checkpoint.state import SAVED_ARGS

    config = parse_args(BASE + YARN_FLAGS, world_size=1)
    mcore = model_builders.transformer_config(config.model, config.dims)
    assert {attr: getattr(mcore, attr) for attr, _ in YARN_CONFIG.values()} == {
        "yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 8,
        "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 0.8,
        "yarn_mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": False}
    assert set(YARN_CONFIG) <= set(SAVED_ARGS)
    spawn(_build_yarn_model, 1)


def test_padded_vocab_size_is_taken_as_given():
    assert model_vocab_size(50257, None, 128, 2) == 50432
    assert model_vocab_size(256, 320, 128, 1) == 320
    with pytest.raises(ConfigError, match="--padded-vocab-size"):
        model_vocab_size(256, 200, 128, 1)
    assert "divisible by --tensor-model-parallel-size" in problem(
        BASE + ["--padded-vocab-size", "321", "--tensor-model-parallel-size", "2"], world_size=2)


def test_use_mup_names_the_megatron_core_version_it_needs():
    from megatron.core import package_info

    said = problem(BASE + ["--use-mup"])
    if "use_mup" in model_builders.TransformerConfig.__dataclass_fields__:
        assert said == ""
    else:
        assert "--use-mup needs megatron-core >= 0.19" in said and package_info.__version__ in said


def test_split_in_literal_quotes_and_the_default_tokenizer(corpus_prefix, sp_model):
    # Megatron-LM's pretrain_gpt.py default type: GPT2BPETokenizer, which needs its files.
    said = problem(DATA_RUN + ["--data-path", corpus_prefix, "--split", "'99,1,0'"])
    assert "--vocab-file" in said and "GPT2BPETokenizer" in said and "--split" not in said, said
    config = parse_args(DATA_RUN + ["--data-path", corpus_prefix, "--split", "'99,1,0'",
                                    "--tokenizer-type", "GPTSentencePieceTokenizer",
                                    "--tokenizer-model", sp_model], world_size=1)
    assert config.data.split == "99,1,0"
    assert parse_args(BASE, world_size=1).data.tokenizer_type == "NullTokenizer"


def test_per_split_data_paths_and_no_mmap(corpus_prefix, sp_model, tmp_path):
    argv = DATA_RUN + ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                       sp_model, "--no-mmap-bin-files"]
    assert "one data source" in problem(argv + ["--data-path", corpus_prefix,
                                                "--train-data-path", corpus_prefix])
    assert "--valid-data-path" in problem(argv + ["--train-data-path", "/nonexistent/x"]) or \
        "--train-data-path" in problem(argv + ["--train-data-path", "/nonexistent/x"])
    config = parse_args(argv + ["--train-data-path", corpus_prefix, "--valid-data-path",
                                corpus_prefix], world_size=1)
    assert config.data.data_path_per_split == [[corpus_prefix], [corpus_prefix], None]
    train, valid, test = build_train_valid_test_datasets(
        build_tokenizer("GPTSentencePieceTokenizer", sp_model), 32, [8, 4, None],
        data_path_per_split=config.data.data_path_per_split, data_cache_path=str(tmp_path),
        mmap_bin_files=not config.data.no_mmap_bin_files)
    assert test is None and len(train) >= 8 and len(valid) >= 4
    # the whole corpus in each split (no --split), read without mmap
    assert len(train.indices) == len(valid.indices) == len(train.dataset)
    assert not train.dataset.mmap
    assert torch.equal(torch.as_tensor(train[0]["tokens"]), torch.as_tensor(valid[0]["tokens"]))


@pytest.mark.parametrize("flag, words", [
    ("--train-iters", ["samples", "dataset index"]),
    ("--seq-length", ["--max-position-embeddings", "weights"]),
    ("--hidden-size", ["--hidden-size 1000000000000", "weights"]),
])
def test_sizes_no_machine_holds_are_one_message(flag, words):
    argv = list(BASE)
    argv[argv.index(flag) + 1] = str(10**12)
    said = problem(argv)
    assert "more than any machine has" in said and all(word in said for word in words), said
    rope = problem(argv + ["--position-embedding-type", "rope"])
    assert "more than any machine has" in rope, rope


def test_a_70b_model_with_a_million_tokens_over_sp64_is_not_bounded():
    assert problem(["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
                    "--group-query-attention", "--num-query-groups", "8",
                    "--ffn-hidden-size", "28672", "--seq-length", str(2**20),
                    "--position-embedding-type", "rope", "--micro-batch-size", "1",
                    "--lr", "1e-3", "--train-iters", "100000", "--mock-data",
                    "--vocab-size", "128256", "--ulysses-sp-size", "64"], world_size=64) == ""


@pytest.mark.parametrize("argv, message", [
    (["--decoder-first-pipeline-num-layers", "1"], None),  # 1 + 3 layers
    (["--account-for-embedding-in-pipeline-split", "--num-layers", "3"], None),  # 1 + 3 "layers"
    (["--decoder-last-pipeline-num-layers", "4"], "leaves 0 layers for the other 1"),
    (["--decoder-first-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"],
     "are exclusive"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], None),  # 2 chunks of 1 layer
    (["--num-virtual-stages-per-pipeline-rank", "2"], None),
    (["--num-layers-per-virtual-pipeline-stage", "3"], "must be divisible by"),
    (["--num-virtual-stages-per-pipeline-rank", "3"], r"must divide the layers of every "
     r"pipeline stage \(2, 2,"),
    (["--decoder-first-pipeline-num-layers", "1", "--num-virtual-stages-per-pipeline-rank", "2"],
     r"\(1, 3,"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--no-overlap-p2p-communication"],
     "needs --pipeline-model-parallel-size > 2"),
    (["--num-layers-per-virtual-pipeline-stage", "1",
      "--num-virtual-stages-per-pipeline-rank", "2"], "are exclusive"),
    (["--overlap-p2p-communication-warmup-flush"], "needs a virtual pipeline"),
    (["--num-layers-per-virtual-pipeline-stage", "1",
      "--microbatch-group-size-per-virtual-pipeline-stage", "5"],
     "runs --global-batch-size's 4 micro batches per step in groups of 5"),
])
def test_pipeline_layout_flags_follow_megatron_lms_rules_on_gpu(argv, message):
    from megatron_ulysses.training.arguments import build_parser, validate_args

    args = build_parser().parse_args(BASE + ["--num-layers", "4", "--global-batch-size", "4",
                                             "--pipeline-model-parallel-size", "2"] + argv)
    if message is None:
        config = validate_args(args, world_size=2, cuda=True)
        mcore = model_builders.transformer_config_kwargs(config.model, config.dims, True)
        assert mcore["num_layers_in_first_pipeline_stage"] == \
            args.decoder_first_pipeline_num_layers
        assert mcore["account_for_embedding_in_pipeline_split"] == \
            args.account_for_embedding_in_pipeline_split
        chunks = 2 if args.num_layers_per_virtual_pipeline_stage or \
            args.num_virtual_stages_per_pipeline_rank else None
        assert mcore["virtual_pipeline_model_parallel_size"] == chunks
        assert mcore["overlap_p2p_comm"] == (chunks is not None) != mcore["batch_p2p_comm"]
        return
    with pytest.raises(ConfigError, match=message):
        validate_args(args, world_size=2, cuda=True)


# --- the flags of the unseen-script sweep -------------------------------------------------------

def test_not_built_flags_are_named_with_why_in_one_message():
    said = problem(BASE + [word for flag in NOT_BUILT for word in (flag, "1")])
    assert said.count("\n") == 1 and "unrecognized" not in said, said
    for flag, why in NOT_BUILT.items():
        assert f"{flag}: {why}" in said, flag


def test_ignored_flags_change_nothing_and_are_said_once():
    argv = []
    for _, _, specs in IGNORED:
        for spec in specs:
            options, kind = compat._options(spec)
            argv += [options[-1]] + {"switch": [], "value": ["7"], "values": ["a", "b"]}[kind]
    config = parse_args(BASE + argv, world_size=1)
    baseline = parse_args(BASE, world_size=1)
    assert dataclasses.replace(config, warnings=()) == baseline
    said = " ".join(config.warnings)
    for _, told, specs in IGNORED:
        for spec in specs:
            first = compat._options(spec)[0][0]
            assert (first in said) == told, first


def test_megatron_lm_alias_spellings_and_what_is_always_done():
    config = parse_args(BASE + ["--override-opt-param-scheduler", "--disable-manual-gc-eval",
                                "--disable-log-loss-scale-to-tensorboard",
                                "--persistent-save-interval", "5", "--accumulate-allreduce-grads-"
                                "in-fp32", "--no-one-logger", "--disable-msc"], world_size=1)
    assert config.optimizer.override_opt_param_scheduler and not config.training.manual_gc_eval
    assert not config.logging.log_loss_scale_to_tensorboard
    assert config.checkpoint.save_interval == 5
    assert config.warnings == ("--save-interval without --save: no checkpoints are written (as "
                               "in Megatron-LM)",)


@pytest.mark.parametrize("argv, words", [
    (["--softmax-type", "learnable"], ["--softmax-type learnable", "vanilla"]),
    (["--rope-type", "yarn"], ["--rope-type yarn", "only rope"]),
    (["--glu-linear-offset", "1.0"], ["--glu-linear-offset 1.0"]),
    (["--dataloader-type", "cyclic"], ["--dataloader-type cyclic", "only single"]),
    (["--error-injection-rate", "100"], ["--error-injection-rate 100", "rerun engine"]),
    (["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size 2", "use 1"]),
    (["--expert-model-parallel-size", "2", "--num-experts", "8"],
     ["MoE (--num-experts)", "--expert-model-parallel-size 2"]),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     ["--recompute-granularity full, not selective"]),
    (["--ddp-bucket-size", "10", "--ddp-num-buckets", "2"], ["not both"]),
    (["--decrease-batch-size-if-needed", "--global-batch-size", "1"],
     ["--global-batch-size (1) is smaller than"]),
    (["--step-batch-size-schedule", "0:2", "--decrease-batch-size-if-needed"], ["not both"]),
    (["--embedding-init-method-std", "0"], ["--embedding-init-method-std must be positive"]),
])
def test_sweep_flags_refused_in_one_message_naming_the_flag(argv, words):
    said = problem(BASE + argv, world_size=2)
    assert said.count("\n") <= 1 and "unrecognized" not in said, said
    for word in words:
        assert word in said, said


def test_sweep_flags_taken_with_megatron_lms_meaning():
    config = parse_args(BASE + [
        "--softmax-type", "vanilla", "--rope-type", "rope", "--glu-linear-offset", "0",
        "--dataloader-type", "single", "--error-injection-rate", "0", "--expert-model-parallel-"
        "size", "1", "--expert-tensor-parallel-size", "4", "--recompute-num-layers", "1",
        "--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm", "--embedding-init-method-std",
        "0.5", "--start-eval-at-iter", "3", "--pytorch-profiler-collect-shapes",
        "--global-batch-size", "7", "--decrease-batch-size-if-needed"], world_size=2)
    said = " ".join(config.warnings)
    assert "--expert-tensor-parallel-size 4 is ignored" in said
    assert "--recompute-method/--recompute-num-layers are ignored" in said
    assert config.model.recompute_num_layers is None
    assert config.optimizer.apply_wd_to_qk_layernorm and "deprecated" in said
    mcore = model_builders.transformer_config(config.model, config.dims)
    assert mcore.embedding_init_method_std == 0.5 and mcore.init_method_std == 0.02
    assert config.training.pytorch_profiler_collect_shapes
    # DP 2 x micro batch 1: 7 -> 6, said once
    assert config.training.global_batch_size == 6 and "7 -> 6" in said
    # the bash-split schedule is the quoted one
    i = BASE.index("--train-iters")
    by_samples = BASE[:i] + BASE[i + 2:] + ["--train-samples", "8"]
    split = parse_args(by_samples + ["--step-batch-size-schedule", "0:1", "64:2"], world_size=1)
    whole = parse_args(by_samples + ["--step-batch-size-schedule", "0:1 64:2"], world_size=1)
    assert split.training.batch_size_schedule == whole.training.batch_size_schedule
    assert split.training.train_iters == whole.training.train_iters


@pytest.mark.parametrize("start, evaluated, counts", [
    (None, [2, 4, 6], {1: 0, 2: 1, 6: 3}),
    (3, [4, 6], {2: 0, 3: 0, 4: 1, 6: 2}),
    (4, [4, 6], {3: 0, 4: 1, 6: 2}),
])
def test_start_eval_at_iter_skips_the_evaluations_before_it(start, evaluated, counts):
    argv = BASE + ["--eval-interval", "2", "--train-iters", "6"] + (
        ["--start-eval-at-iter", str(start)] if start is not None else [])
    training = parse_args(argv, world_size=1).training
    assert [i for i in range(1, 7) if training.evaluates_after(i)] == evaluated
    assert {i: training.evaluations_through(i) for i in counts} == counts


def test_no_pad_vocab_size_keeps_the_tokenizers_rows():
    assert model_vocab_size(250, None, 128, 1, pad=False) == 250
    assert model_vocab_size(250, 320, 128, 2, pad=False) == 320
    with pytest.raises(ConfigError, match="--no-pad-vocab-size"):
        model_vocab_size(251, None, 128, 2, pad=False)
    assert not parse_args(BASE + ["--no-pad-vocab-size"], world_size=1).model.pad_vocab_size


def test_data_args_files_give_the_data_paths(corpus_prefix, sp_model, tmp_path):
    argv = DATA_RUN + ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                       sp_model]
    blend = tmp_path / "blend.txt"
    blend.write_text(f"0.3 {corpus_prefix}\n0.7 {corpus_prefix}\n")
    config = parse_args(argv + ["--data-args-path", str(blend)], world_size=1)
    assert config.data.data_path == ("0.3", corpus_prefix, "0.7", corpus_prefix)
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": corpus_prefix, "valid": [1, corpus_prefix],
                                  "test": None}))
    config = parse_args(argv + ["--per-split-data-args-path", str(splits)], world_size=1)
    assert config.data.data_path_per_split == [[corpus_prefix], ["1", corpus_prefix], None]
    assert "not both" in problem(argv + ["--data-args-path", str(blend), "--data-path",
                                         corpus_prefix])
    assert "--data-args-path" in problem(argv + ["--data-args-path", str(tmp_path / "no")])
    splits.write_text("[1]")
    assert "not a JSON object" in problem(argv + ["--per-split-data-args-path", str(splits)])


def test_use_mp_args_from_checkpoint_args_forces_tp_and_pp(monkeypatch, tmp_path):
    from megatron_ulysses.training.checkpoint import load as checkpoint_load

    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
             "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    monkeypatch.setattr(checkpoint_load, "read_checkpoint_args", lambda root: saved)
    argv = ["--use-checkpoint-args", "--load", str(tmp_path), "--seq-length", "32",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
            "--vocab-size", "64", "--tensor-model-parallel-size", "1"]
    assert parse_args(argv, world_size=2).dims.tp == 1  # the command line wins
    assert parse_args(argv + ["--use-mp-args-from-checkpoint-args"], world_size=2).dims.tp == 2


def test_gradient_bucket_flags_reach_the_ddp_config_on_cpu():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron_ulysses.training.model import ddp_config_kwargs

    config = parse_args(BASE + ["--ddp-bucket-size", "1000",
                                "--ddp-pad-buckets-for-high-nccl-busbw",
                                "--no-gradient-reduce-div-fusion",
                                "--ddp-reduce-scatter-with-fp32-accumulation"], world_size=1)
    ddp = DistributedDataParallelConfig(**ddp_config_kwargs(config.optimizer, config.performance))
    assert (ddp.bucket_size, ddp.pad_buckets_for_high_nccl_busbw,
            ddp.gradient_reduce_div_fusion) == (1000, True, False)
    # as Megatron-LM: off when the gradients already reduce in fp32
    assert not ddp.reduce_scatter_with_fp32_accumulation
    assert any("already reduce in fp32" in w for w in config.warnings)
    said = problem(BASE + ["--ddp-num-buckets", "4"])
    if "num_buckets" in DistributedDataParallelConfig.__dataclass_fields__:
        assert said == ""
    else:
        assert "--ddp-num-buckets needs megatron-core >= 0.19" in said, said


def test_precision_aware_dtypes_and_first_last_bf16_layers_on_gpu():
    from test_perf_flags import DIST_OPT, FP8, on_gpu

    from megatron_ulysses.training.config import performance

    with pytest.raises(ConfigError, match="--main-grads-dtype other than fp32 needs "
                       "--use-precision-aware-optimizer"):
        on_gpu(["--bf16", "--main-grads-dtype", "bf16"])
    aware = ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer"]
    with pytest.raises(ConfigError, match="--accumulate-allreduce-grads-in-fp32 needs "
                       "--main-grads-dtype fp32"):
        on_gpu(aware + ["--main-grads-dtype", "bf16", "--accumulate-allreduce-grads-in-fp32"])
    perf = on_gpu(aware + ["--main-grads-dtype", "bf16", "--exp-avg-dtype", "fp8",
                           "--exp-avg-sq-dtype", "bf16", "--main-params-dtype", "fp16"]).performance
    kwargs = performance.optimizer_kwargs(perf)
    assert (kwargs["main_grads_dtype"], kwargs["main_params_dtype"], kwargs["exp_avg_dtype"],
            kwargs["exp_avg_sq_dtype"]) == (torch.bfloat16, torch.float16, torch.uint8,
                                            torch.bfloat16)
    assert not performance.ddp_kwargs(perf)["grad_reduce_in_fp32"]  # bf16 main grads
    with pytest.raises(ConfigError, match="not supported with --fp8-recipe delayed"):
        on_gpu(FP8 + ["--first-last-layers-bf16"])
    with pytest.raises(ConfigError, match=r"--num-layers-at-end-in-bf16 \(3\) must be between 0"):
        on_gpu(FP8 + ["--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
                      "--num-layers-at-end-in-bf16", "3"])
    # FP8 options without --fp8-format: ignored as in Megatron-LM (also on CPU), said once
    for config in (on_gpu(["--bf16", "--no-fp8-wgrad", "--fp8-recipe", "tensorwise"]),
                   parse_args(BASE + ["--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
                                      "max", "--first-last-layers-bf16"], world_size=1)):
        assert config.performance.fp8 is None and config.performance.fp8_wgrad
        assert config.performance.fp8_recipe == "delayed"
        assert config.performance.fp8_amax_history_len == 1
        assert any("no effect without --fp8-format (as in Megatron-LM)" in w
                   for w in config.warnings)
    perf = on_gpu(FP8 + DIST_OPT + ["--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
                                    "--num-layers-at-start-in-bf16", "2", "--disable-fp8-wgrad",
                                    "--disable-bf16-reduced-precision-matmul"]).performance
    core = performance.transformer_kwargs(perf)
    assert (core["first_last_layers_bf16"], core["num_layers_at_start_in_bf16"],
            core["num_layers_at_end_in_bf16"], core["fp8_wgrad"],
            core["disable_bf16_reduced_precision_matmul"]) == (True, 2, 1, False, True)
    said = problem(BASE + ["--disable-bf16-reduced-precision-matmul"])
    assert "--disable-bf16-reduced-precision-matmul needs CUDA" in said, said


def test_fsdp2_no_reshard_after_forward_reaches_its_config():
    from megatron.core.distributed import TorchFullyShardedDataParallelConfig
    from megatron_ulysses.training.model import ddp_config_kwargs

    fsdp2 = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]
    for extra, reshard in (([], True), (["--torch-fsdp2-no-reshard-after-forward"], False)):
        config = parse_args(BASE + fsdp2 + extra, world_size=1)
        kwargs = ddp_config_kwargs(config.optimizer, config.performance)
        assert TorchFullyShardedDataParallelConfig(**kwargs).reshard_after_forward is reshard


def _build_with_embedding_std(rank, world_size):
    with _built_model(["--embedding-init-method-std", "1.0"]) as model:
        params = dict(model.named_parameters())
        embedding = next(p for name, p in params.items() if "word_embeddings" in name)
        qkv = next(p for name, p in params.items() if "linear_qkv.weight" in name)
        assert abs(embedding.std().item() - 1.0) < 0.05, embedding.std()
        assert abs(qkv.std().item() - 0.02) < 0.005, qkv.std()  # --init-method-std's


def test_embedding_init_method_std_initializes_the_embedding_only():
    spawn(_build_with_embedding_std, 1)


def test_query_groups_default_and_ignore_as_megatron_lm():
    # --group-query-attention alone: Megatron-LM's --num-query-groups default 1 (MQA);
    # --num-query-groups without it: ignored (every head its own kv), said once.
    assert parse_args(BASE + ["--group-query-attention"], world_size=1).model.num_query_groups == 1
    config = parse_args(BASE + ["--num-query-groups", "2"], world_size=1)
    assert config.model.num_query_groups == 8
    assert any("--num-query-groups 2 is ignored without --group-query-attention" in w
               for w in config.warnings)
    assert "positive --num-query-groups" in problem(BASE + ["--group-query-attention",
                                                            "--num-query-groups", "0"])
