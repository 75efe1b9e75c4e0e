"""Megatron-LM's own scripts run here: every set of `megatron_lm_args` (dense-GPT examples and
functional-test configs, shrunk) is accepted with `--ulysses-sp-size 2`, out-of-scope sets are
refused in one message naming every such flag, and a handful train end to end (one at SP 2 with
the losses of SP 1).

The parse tests are in-process (`parse_args(argv, world_size=2)`), so all sets cost seconds; only
`TRAIN_RUNS` start processes (tests/helpers/launcher.py).
"""

import contextlib
import importlib.util
import io

import preprocess_data
import pytest
from conftest import CORPUS, REPO_ROOT
from megatron_lm_args import REFUSED_SETS, TRAIN_RUNS, TRAIN_SETS, fill
from launcher import pretrain
from test_cli import launch, losses, validation

from megatron_ulysses.training.arguments import ConfigError, build_parser, parse_args
from megatron_ulysses.training.config.megatron_lm.refused import out_of_scope

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test

SP2 = ["--ulysses-sp-size", "2"]


@pytest.fixture(scope="module")
def gpt2_data(gpt2_files, tmp_path_factory):
    """The corpus as GPT-2 BPE `.bin/.idx`, as Megatron-LM's functional tests' data is made."""
    vocab_file, merge_file = gpt2_files
    prefix = str(tmp_path_factory.mktemp("gpt2_data") / "corpus")
    assert preprocess_data.main([
        "--input", str(CORPUS), "--output-prefix", prefix, "--json-keys", "text",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
        "--merge-file", merge_file, "--append-eod", "--workers", "1",
    ]) == 0
    return prefix + "_text_document"


@pytest.fixture
def paths(gpt2_files, gpt2_data, sp_model, corpus_prefix, hf_dir, tmp_path):
    """Every `megatron_lm_args.PLACEHOLDERS` key -> a real path (fresh directories per test)."""
    for name in ("cache", "ckpt", "tensorboard", "wandb"):
        (tmp_path / name).mkdir()
    return {"{GPT2_DATA}": gpt2_data, "{SP_DATA}": corpus_prefix,
            "{VOCAB_FILE}": gpt2_files[0], "{MERGE_FILE}": gpt2_files[1],
            "{SP_MODEL}": sp_model, "{HF_TOKENIZER}": hf_dir,
            "{CACHE}": str(tmp_path / "cache"), "{CKPT}": str(tmp_path / "ckpt"),
            "{TENSORBOARD}": str(tmp_path / "tensorboard"), "{WANDB}": str(tmp_path / "wandb"),
            "{TP_COMM_OVERLAP_CFG}": str(tmp_path / "tp_comm_overlap.yaml")}


def _unmet(needs) -> list:
    """The items of a set's `needs` this environment lacks."""
    from megatron.core import package_info

    core = (package_info.MAJOR, package_info.MINOR)
    unmet = []
    for need in needs:
        if need.startswith("megatron-core>="):
            wanted = tuple(int(part) for part in need.split(">=")[1].split("."))
            unmet += [need] if core < wanted else []
        elif importlib.util.find_spec(need) is None:
            unmet.append(need)
    return unmet


def _problem(argv) -> str:
    """The one message with which parsing `argv` at world size 2 stops ('' if it does not)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse_args(argv, world_size=2)
    except ConfigError as error:
        return str(error)
    except SystemExit as exit_:
        assert exit_.code == 2, stderr.getvalue()
        return stderr.getvalue()
    return ""


def _flags(argv) -> set:
    return {word for word in argv if word.startswith("--")}


def _id(source: str) -> str:
    """A test id: the functional-test case, or the example script's file name."""
    parts = source.split("/")
    return parts[-2] if parts[-1] == "model_config.yaml" else parts[-1]


def _unknown(problem: str) -> bool:
    """argparse's 'unrecognized arguments': a flag of the table is not even known."""
    return "unrecognized arguments" in problem


@pytest.mark.parametrize("argset", TRAIN_SETS, ids=lambda s: _id(s.source))
def test_megatron_lm_set_is_accepted_at_sp2(argset, paths):
    problem = _problem(fill(argset.argv, paths) + SP2)
    unmet = _unmet(argset.needs)
    if not unmet:
        assert problem == "", f"{argset.source}: {problem}"
        return
    # Without an optional package (or megatron-core version) the flag that needs it is named,
    # with what is missing: never 'unrecognized arguments'.
    assert not _unknown(problem), problem
    assert any(flag in problem for flag in _flags(argset.argv)), problem
    assert any(need.split(">=")[0] in problem for need in unmet), problem


@pytest.mark.parametrize("argset", TRAIN_SETS, ids=lambda s: _id(s.source))
def test_gpu_flags_of_the_set_are_megatron_lms(argset):
    # The GPU suite appends `gpu`; here every flag of the set must at least be known (a GPU-only
    # flag is validated, and on CPU refused by name, never as an unknown flag).
    known = set(build_parser().option_strings())
    assert sorted(_flags(argset.argv + argset.gpu) - known) == []


@pytest.mark.parametrize("refused", REFUSED_SETS, ids=lambda s: _id(s.source))
def test_out_of_scope_set_is_refused_in_one_message(refused, paths):
    problem = _problem(fill(refused.argv, paths) + SP2)
    assert problem, f"{refused.source} was accepted ({refused.why})"
    assert not _unknown(problem), f"refused as unknown flags, not as out of scope:\n{problem}"
    missing = [name for name in refused.names if name not in problem]
    assert missing == [], f"{refused.why}: the message does not name {missing}:\n{problem}"


def test_every_megatron_lm_flag_is_taken_or_refused_by_name():
    # An unseen Megatron-LM script never meets a bare 'unrecognized arguments': each option of
    # Megatron-LM's parser is a flag here (taken, or accepted with no effect) or refused by name.
    listed = REPO_ROOT / "tests" / "helpers" / "megatron_lm_flags.txt"
    flags = [line.strip() for line in listed.open()
             if line.startswith("--")]
    assert len(flags) > 800
    known = set(build_parser().option_strings())
    unknown = [flag for flag in flags if flag not in known]
    named = {flag for group in out_of_scope(unknown).values() for flag in group}
    assert sorted(set(unknown) - named) == []


def test_every_parse_problem_is_in_the_one_message():
    # Megatron-LM's argparse stops at the first bad value, so a script takes one round per
    # problem; here one message lists the bad choice, the bad number, the out-of-scope flag and
    # the unknown flag together.
    problem = _problem([
        "--num-layers", "two", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "64", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "3",
        "--mock-data", "--vocab-size", "256", "--lr-decay-style", "cosin", "--num-experts", "8",
        "--no-such-flag", *SP2])
    for part in ("--num-layers", "two", "--lr-decay-style", "cosin", "--num-experts",
                 "--no-such-flag"):
        assert part in problem, f"{part!r} missing from:\n{problem}"


@pytest.mark.parametrize("size, accepted", [("1", True), ("2", False)])
def test_context_parallel_size_1_is_accepted_more_points_to_ulysses(size, accepted):
    problem = _problem([
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "64", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "3",
        "--mock-data", "--vocab-size", "256", "--context-parallel-size", size, *SP2])
    if accepted:
        assert problem == ""
    else:
        assert "--context-parallel-size" in problem and "--ulysses-sp-size" in problem, problem


@pytest.mark.parametrize("source", TRAIN_RUNS, ids=_id)
def test_megatron_lm_set_trains_at_sp2(source, paths, tmp_path):
    argset = next(s for s in TRAIN_SETS if s.source == source)
    if _unmet(argset.needs):
        pytest.skip(f"needs {_unmet(argset.needs)}")
    # Megatron-LM's default --log-interval is 100: log each of the 3 iterations
    run = pretrain(2, fill(argset.argv, paths) + SP2 + ["--log-interval", "1"], timeout=600)
    got = losses(run)
    assert sorted(got) == [1, 2, 3], run.stdout[-1500:] + run.stderr[-1500:]
    if source != TRAIN_RUNS[0]:
        return
    # SP 2 trains the same model as SP 1 (its own checkpoint directory: --load would resume).
    sp1_ckpt = tmp_path / "ckpt_sp1"
    sp1_ckpt.mkdir()
    expected = losses(pretrain(1, fill(argset.argv, {**paths, "{CKPT}": str(sp1_ckpt)}),
                                timeout=600))
    assert got == pytest.approx(expected, rel=2e-6)


def test_sweep_flags_run_end_to_end():
    # One short run (1 process) with flags the sweep added: evaluations start at
    # --start-eval-at-iter, --exit-signal-handler runs without --save (Megatron-LM's exit without
    # saving), and Megatron-LM's telemetry / tuning flags are accepted with no effect.
    run = launch(1, "--mock-data", "--vocab-size", "256", "--train-iters", "4",
                 "--eval-interval", "1", "--eval-iters", "1", "--start-eval-at-iter", "3",
                 "--exit-signal-handler", "--log-straggler", "--no-one-logger", "--local-rank",
                 "0", "--ddp-bucket-size", "5000", "--high-priority-stream-groups", "dp", "tp")
    assert sorted(losses(run)) == [1, 2, 3, 4]
    assert sorted(validation(run)) == [3, 4]
    assert "--log-straggler: accepted with no effect here" in run.stdout + run.stderr
