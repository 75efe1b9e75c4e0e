"""Bad configurations and inputs end with one message naming the flag, exit status 2, nothing
written, no traceback, no hang: flag values are checked by `parse_args` (table PARSE), tokenizer
and data files by `pretrain_gpt.py` before any process group (table FILES: the first case of each
kind through the CLI, the others through the check the CLI runs, in-process)."""

import importlib.util
import os
import re
import subprocess
import sys
import warnings

import numpy
import pytest
import torch
from conftest import REPO_ROOT

from megatron_ulysses.data.datasets import DataError, split_document_ranges
from megatron_ulysses.data.sharding import get_batch_for_sp_rank
from megatron_ulysses.training.arguments import ConfigError, parse_args

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
         "--seq-length", "32", "--position-embedding-type", "rope", "--attention-dropout", "0",
         "--hidden-dropout", "0"]
RUN = ["--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2", "--num-workers", "0",
       "--eval-iters", "0"]
BASE = [*MODEL, *RUN, "--mock-data", "--vocab-size", "64"]
DATA = [*MODEL, *RUN, "--data-path", "{d100}", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "64"]
TE = importlib.util.find_spec("transformer_engine") is not None
VOCAB = 100  # ids of the data sets made below


def without(argv, flag):
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


NO_ITERS = without(BASE, "--train-iters")


PARSE = [
    # --data-path: missing files and bad blend weights are found by parse_args
    (without(DATA, "--data-path") + ["--data-path", "{root}/absent"],
     ["--data-path prefixes without .bin/.idx files", "absent"]),
    # a quoted "$DATA_PATH": the whole blend is one word
    (without(DATA, "--data-path") + ["--data-path", "0.5 {d100} 0.5 {d854}"],
     ["--data-path prefixes without .bin/.idx files", "one word holds a whole blend",
      "as separate words (unquoted)", "d100 0.5 "]),
    (without(DATA, "--data-path") + ["--data-path", "-1", "{d100}", "2", "{d854}"],
     ["--data-path", "blend weights must be positive"]),
    # megatron-core's BlendedDataset asserts every weight > 0 (a raw traceback after init)
    (without(DATA, "--data-path") + ["--data-path", "1", "{d100}", "0", "{d854}"],
     ["--data-path", "blend weights must be positive", "leave a prefix out"]),
    # --split: syntax, no training split (megatron-core's own parser drops signs and letters)
    (DATA + ["--split", "0,100,0"], ["--split 0,100,0", "train split weight 0"]),
    (DATA + ["--split", "abc"], ["--split 'abc'", "non-negative"]),
    (DATA + ["--split", "90,5,4,1"], ["--split '90,5,4,1'", "4 parts"]),
    (DATA + ["--split=-10,90,0"], ["--split '-10,90,0'", "non-negative"]),
    (DATA + ["--split", "0,0,0"], ["--split '0,0,0'", "every split weight 0"]),
    (BASE + ["--split", "9e1,1,0"], ["--split '9e1,1,0'", "non-negative"]),
    # model shape
    (BASE + ["--make-vocab-size-divisible-by", "0"], ["--make-vocab-size-divisible-by", ">= 1"]),
    (BASE + ["--ffn-hidden-size", "0"], ["--ffn-hidden-size must be positive, got 0"]),
    (BASE + ["--ffn-hidden-size=-5"], ["--ffn-hidden-size must be positive, got -5"]),
    (BASE + ["--kv-channels", "0"], ["--kv-channels must be positive, got 0"]),
    (BASE + ["--max-position-embeddings", "0"], ["--max-position-embeddings must be positive"]),
    (BASE + ["--vocab-size", "0"], ["--vocab-size must be positive, got 0"]),
    (BASE + ["--attention-dropout", "1"], ["--attention-dropout must be in [0, 1)", "got 1.0"]),
    (BASE + ["--attention-dropout=-0.1"], ["--attention-dropout must be in [0, 1)"]),
    (BASE + ["--hidden-dropout", "1.5"], ["--hidden-dropout must be in [0, 1)", "1.5"]),
    (BASE + ["--rotary-base", "0"], ["--rotary-base must be positive, got 0"]),
    (BASE + ["--rotary-base=-10000"], ["--rotary-base must be positive, got -10000"]),
    (BASE + ["--rotary-percent", "0"], ["--rotary-percent must be in (0, 1]"]),
    (BASE + ["--rotary-percent", "1.5"], ["--rotary-percent must be in (0, 1]", "1.5"]),
    (BASE + ["--rotary-percent", "0.2"], ["--kv-channels x --rotary-percent = 8 x 0.2 -> 1",
                                          "even"]),
    (BASE + ["--norm-epsilon", "0"], ["--norm-epsilon must be positive, got 0.0"]),
    (BASE + ["--norm-epsilon=-1e-5"], ["--norm-epsilon must be positive"]),
    (BASE + ["--init-method-std", "0"], ["--init-method-std must be positive"]),
    # run, schedule, optimizer
    (BASE + ["--micro-batch-size", "0"], ["--micro-batch-size must be positive, got 0"]),
    (BASE + ["--num-workers=-1"], ["--num-workers must be >= 0, got -1"]),
    (BASE + ["--seed=-1"], ["--seed must be in [0, 4294967295], got -1"]),
    (BASE + ["--distributed-timeout-minutes", "0"], ["--distributed-timeout-minutes", ">= 1"]),
    (BASE + ["--exit-interval=-1"], ["--exit-interval must be positive, got -1"]),
    (BASE + ["--exit-interval", "0"], ["--exit-interval must be positive, got 0"]),
    (BASE + ["--tensorboard-log-interval", "0"], ["--tensorboard-log-interval", ">= 1"]),
    (NO_ITERS + ["--train-samples", "3", "--global-batch-size", "4"],
     ["--train-samples (3) must be >= --global-batch-size (4)"]),
    (BASE + ["--lr-decay-iters", "0"], ["--lr-decay-iters must be positive, got 0"]),
    (BASE + ["--lr-warmup-iters", "2"],
     ["--lr-warmup-iters (2 iterations) must be < --lr-decay-iters (default --train-iters) (2)"]),
    (NO_ITERS + ["--train-samples", "8", "--global-batch-size", "4", "--lr-warmup-iters", "2"],
     ["--lr-warmup-iters goes with --train-iters; with --train-samples give "
      "--lr-warmup-samples"]),
    (NO_ITERS + ["--train-samples", "8", "--global-batch-size", "4", "--lr-warmup-samples",
                 "8"], ["--lr-warmup-samples (8 samples) must be < --lr-decay-samples (default "
                        "--train-samples) (8)"]),
    (BASE + ["--lr-warmup-iters", "5", "--lr-decay-iters", "3"],
     ["--lr-warmup-iters (5 iterations) must be < --lr-decay-iters (3)"]),
    (BASE + ["--lr-warmup-iters=-1"], ["--lr-warmup-iters must be >= 0, got -1"]),
    (BASE + ["--lr-warmup-fraction", "1"], ["--lr-warmup-fraction must be in [0, 1)"]),
    (BASE + ["--lr=-1e-3"], ["--lr must be >= 0, got -0.001"]),
    (BASE + ["--lr", "nan"], ["--lr must be >= 0, got nan"]),
    (BASE + ["--weight-decay=-0.1"], ["--weight-decay must be >= 0, got -0.1"]),
    (BASE + ["--clip-grad=-1"], ["--clip-grad must be >= 0, got -1.0"]),
    (BASE + ["--adam-beta1", "1"], ["--adam-beta1 must be in [0, 1), got 1.0"]),
    (BASE + ["--adam-beta1=-0.1"], ["--adam-beta1 must be in [0, 1)"]),
    (BASE + ["--adam-beta2", "1.5"], ["--adam-beta2 must be in [0, 1), got 1.5"]),
    (BASE + ["--adam-eps", "0"], ["--adam-eps must be positive, got 0.0"]),
    (BASE + ["--adam-eps=-1e-8"], ["--adam-eps must be positive"]),
    (BASE + ["--loss-scale", "0"], ["--loss-scale must be positive, got 0.0"]),
    (BASE + ["--loss-scale=-1"], ["--loss-scale must be positive"]),
    (BASE + ["--initial-loss-scale", "0"], ["--initial-loss-scale must be positive"]),
    (BASE + ["--min-loss-scale", "0"], ["--min-loss-scale must be positive"]),
    (BASE + ["--loss-scale-window", "0"], ["--loss-scale-window must be positive"]),
    (BASE + ["--hysteresis", "0"], ["--hysteresis must be >= 1, got 0"]),
    (BASE + ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "0"], ["--recompute-num-layers must be positive"]),
    (BASE + ["--recompute-granularity", "full", "--recompute-method", "block",
             "--recompute-num-layers", "3"], ["--recompute-num-layers (3) must be in [1,", "2]"]),
    (BASE + ["--num-layers", "3", "--recompute-granularity", "full", "--recompute-method",
             "uniform", "--recompute-num-layers", "2"],
     ["--recompute-method uniform", "--recompute-num-layers (2) to divide", "stage (3)"]),
    # output directories that cannot be written: found now, not after training
    (BASE + ["--save", "{file}/ckpt"], ["--save", "is under the file", "not a directory"]),
    (BASE + ["--save", "{file}"], ["--save", "is a file, not a directory"]),
    (BASE + ["--save", "{readonly}/ckpt"], ["--save", "is not writable"]),
    (BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-file", "{file}", "--merge-file",
             "{file}"],
     ["--vocab-file and --merge-file are not used by --tokenizer-type NullTokenizer"]),
    (BASE + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{file}"],
     ["--tokenizer-type GPT2BPETokenizer needs --merge-file"]),
    (BASE + ["--tensorboard-dir", "{file}/tb"], ["--tensorboard-dir", "is under the file"]),
    (BASE + ["--tensorboard-dir", "{readonly}/tb"], ["--tensorboard-dir", "is not writable"]),
    (BASE + ["--data-cache-path", "{file}/cache"], ["--data-cache-path", "is under the file"]),
]
if not TE:
    PARSE += [
        (BASE + ["--ulysses-attention-backend", "te"],
         ["--ulysses-attention-backend te needs Transformer Engine", "sdpa", "local"]),
        (BASE + ["--transformer-impl", "transformer_engine"],
         ["--transformer-impl transformer_engine needs Transformer Engine",
          "--transformer-impl local"]),
    ]


@pytest.fixture
def paths(tmp_path):
    """`{file}`: a regular file; `{readonly}`: a directory nobody may write (as root, where
    permission bits do not stop writes, /proc)."""
    regular = tmp_path / "a_file"
    regular.write_text("not a directory")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    yield {"file": str(regular), "readonly": "/proc" if os.geteuid() == 0 else str(readonly)}
    readonly.chmod(0o755)


@pytest.mark.parametrize("argv, words", PARSE, ids=[words[0] for _, words in PARSE])
def test_bad_flag_values_are_config_errors(argv, words, paths, files, tmp_path):
    argv = [arg.format(**paths, **files) for arg in argv]
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError) as error:
        parse_args(argv, world_size=1)
    message = str(error.value)
    for word in words:
        assert word in message, message
    assert "\n" not in message
    assert sorted(os.listdir(tmp_path)) == before  # no directory made (nor left behind)
    assert not os.path.exists(os.path.join(paths["file"], "ckpt"))


def test_warnings_name_both_flags_and_a_valid_split_of_weight_0_is_fine(files):
    data = [arg.format(**files) for arg in DATA]
    args = parse_args(BASE + ["--reset-position-ids"], world_size=1)
    assert len(args.warnings) == 1
    assert "--reset-position-ids" in args.warnings[0]
    assert "--reset-attention-mask" in args.warnings[0]
    assert parse_args(BASE + ["--reset-position-ids", "--reset-attention-mask"],
                      world_size=1).warnings == ()
    assert parse_args(BASE + ["--reset-position-ids", "--position-embedding-type",
                              "learned_absolute"], world_size=1).warnings == ()
    args = parse_args(without(data, "--eval-iters") + ["--split", "99,0,1"], world_size=1)
    assert args.warnings == ("--split 99,0,1 gives the valid split weight 0: no evaluation runs "
                             "(--eval-iters 100 is ignored); give it a weight to evaluate",)
    assert parse_args(data + ["--split", "99,0,1"], world_size=1).warnings == ()  # eval-iters 0


@pytest.mark.parametrize("split", ["100", "98,2", "969/30/1", " 90, 10, 0", "0.9,.1,0"])
def test_megatron_lm_split_spellings_are_accepted(files, split):
    data = [arg.format(**files) for arg in DATA]
    assert parse_args(data + ["--split", split], world_size=1).data.split == split


@pytest.mark.parametrize("documents", [1, 7, 100, 499, 854, 10**6 + 3])
@pytest.mark.parametrize("split", ["969,30,1", "98,2,0", "1,1,1", "90,5,5", "100"])
def test_split_document_counts_match_megatron_core(split, documents):
    """The documents per split that the check computes are the ones megatron-core builds."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    expected = [None if m is None else (int(round(m[0] * float(documents))),
                                        int(round(m[1] * float(documents))))
                for m in matrix]
    assert split_document_ranges(split, documents) == expected


def _write_dataset(prefix, lengths, vocab=VOCAB, seed=0):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    with warnings.catch_warnings():  # numpy 2 about torch's __array__, once per document
        warnings.simplefilter("ignore", DeprecationWarning)
        for length in lengths:
            builder.add_document(torch.from_numpy(rng.integers(0, vocab, length)), [length])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import sentencepiece

    root = tmp_path_factory.mktemp("bad_inputs")
    garbage = numpy.random.default_rng(1).integers(0, 256, 4096, dtype=numpy.uint8).tobytes()
    made = {"root": str(root)}
    made["d100"] = _write_dataset(str(root / "d100"), [20] * 100)  # < ~500 documents
    made["d854"] = _write_dataset(str(root / "d854"), [20] * 854)
    (root / "garbage.model").write_bytes(garbage)
    made["garbage_model"] = str(root / "garbage.model")
    (root / "garbage_hf").mkdir()
    (root / "garbage_hf" / "tokenizer.json").write_bytes(garbage)
    made["garbage_hf"] = str(root / "garbage_hf")

    def damaged(name, idx=None, bin_=None):
        prefix = str(root / name)
        source_idx = open(made["d100"] + ".idx", "rb").read()
        source_bin = open(made["d100"] + ".bin", "rb").read()
        open(prefix + ".idx", "wb").write(source_idx if idx is None else idx(source_idx))
        open(prefix + ".bin", "wb").write(source_bin if bin_ is None else bin_(source_bin))
        made[name] = prefix

    damaged("random_idx", idx=lambda _: garbage)
    damaged("short_header", idx=lambda data: data[:20])
    damaged("cut_idx", idx=lambda data: data[:len(data) // 2])
    damaged("short_bin", bin_=lambda data: data[:len(data) - 100])
    damaged("bad_version", idx=lambda data: data[:9] + (7).to_bytes(8, "little") + data[17:])
    made["empty"] = _write_dataset(str(root / "empty"), [])
    made["empty_docs"] = _write_dataset(str(root / "empty_docs"), [0, 0, 0])
    # A sentencepiece model without an eos id: GPTSentencePieceTokenizer has no EOD.
    text = root / "text.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in
                              range(200)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(root / "no_eos"), vocab_size=40, eos_id=-1,
        minloglevel=2)
    made["no_eos"] = str(root / "no_eos.model")
    return made


NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]
FILES = [
    # A split of 0 documents: megatron-core loops forever in GPTDataset._get_num_epochs.
    (["--data-path", "{d100}", *NULL],  # the default --split 969,30,1
     ["--split 969,30,1", "test split 0 of the 100 documents", "train 97, valid 3, test 0",
      "set its weight to 0"]),
    (["--data-path", "0.5", "{d854}", "0.5", "{d100}", *NULL, "--split", "969,30,1"],
     ["--split 969,30,1", "test split 0 of the 100 documents", "d100'"]),
    (["--data-path", "{empty_docs}", *NULL, "--split", "1"],
     ["--data-path", "empty_docs", "no tokens"]),
    # damaged or empty data
    (["--data-path", "{random_idx}", *NULL], ["--data-path", "is not a megatron-core index"]),
    (["--data-path", "{short_header}", *NULL], ["--data-path", "is truncated (20 bytes"]),
    (["--data-path", "{cut_idx}", *NULL], ["--data-path", "100 sequences", "needs 2042"]),
    (["--data-path", "{short_bin}", *NULL], ["--data-path", "is 3900 bytes", "2000 tokens"]),
    (["--data-path", "{bad_version}", *NULL], ["--data-path", "index version 7"]),
    (["--data-path", "{empty}", *NULL], ["--data-path", "holds no tokens (0 documents"]),
    # tokenizer files that do not load
    (["--data-path", "{d100}", "--tokenizer-type", "GPTSentencePieceTokenizer",
      "--tokenizer-model", "{garbage_model}"],
     ["--tokenizer-model", "garbage.model", "is not a sentencepiece model"]),
    (["--data-path", "{d100}", "--tokenizer-type", "SentencePieceTokenizer",
      "--tokenizer-model", "{garbage_model}"],
     ["--tokenizer-model", "is not a sentencepiece model", "SentencePieceTokenizer"]),
    (["--data-path", "{d100}", "--tokenizer-type", "SentencePieceTokenizer",
      "--tokenizer-model", "{root}"], ["--tokenizer-model", "is a directory"]),
    (["--data-path", "{d100}", "--tokenizer-type", "HuggingFaceTokenizer",
      "--tokenizer-model", "{garbage_model}"],
     ["--tokenizer-model", "is not a directory", "HuggingFaceTokenizer"]),
    (["--data-path", "{d100}", "--tokenizer-type", "HuggingFaceTokenizer",
      "--tokenizer-model", "{garbage_hf}"], ["HuggingFaceTokenizer", "transformers"]
     if importlib.util.find_spec("transformers") is None else
     ["--tokenizer-model", "is not a HuggingFace tokenizer directory"]),
    (["--data-path", "{d100}", "--tokenizer-type", "GPTSentencePieceTokenizer",
      "--tokenizer-model", "{no_eos}"], ["--tokenizer-model", "no end-of-document id"]),
]


def run_cli(argv, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_message(result, words):
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("pretrain_gpt.py: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in errors[0], errors[0]


# The first FILES case of each kind (a split of 0 documents, damaged data, a tokenizer file) runs
# pretrain_gpt.py as a user meets it; the others run its check_inputs in-process (a process costs
# seconds of imports), which is where pretrain_gpt.py finds them.
THROUGH_THE_CLI = (0, 3, 9)


@pytest.mark.parametrize("case", range(len(FILES)), ids=[words[-1] for _, words in FILES])
def test_bad_files_exit_2_with_one_message(case, files, tmp_path):
    from megatron_ulysses.training.inputs import check_inputs

    argv, words = FILES[case]
    argv = [arg.format(**files) for arg in argv]
    out = ["--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb"),
           "--data-cache-path", str(tmp_path / "cache")]
    if case in THROUGH_THE_CLI:
        result = run_cli([*MODEL, *RUN, *argv, *out], timeout=60)  # a hang fails here
        assert_one_message(result, words)
    else:
        with pytest.raises(ConfigError) as error:
            check_inputs(parse_args([*MODEL, *RUN, *argv, *out], world_size=1))
        message = str(error.value)
        assert "\n" not in message, message
        for word in words:
            assert word in message, message
    assert os.listdir(tmp_path) == []  # no checkpoint, TensorBoard or index cache directory


def test_bad_token_ids_raise_in_get_batch_for_sp_rank():
    tokens = torch.tensor([[1, 2, 99, 3], [4, 5, 6, 7]])
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
             "loss_mask": torch.ones(2, 4), "position_ids": torch.arange(4).expand(2, 4)}
    get_batch_for_sp_rank(batch, 0, 2, 0, 7, vocab_size=100)  # in range: fine
    get_batch_for_sp_rank(batch, 0, 2, 0, 7)  # no vocab_size: no check
    with pytest.raises(DataError) as error:
        get_batch_for_sp_rank(batch, 1, 2, 0, 7, vocab_size=64)
    message = str(error.value)
    assert isinstance(error.value, ValueError)
    for word in ("token id 99", "vocabulary of 64 ids", "--tokenizer-model", "--vocab-size",
                 "--data-path"):
        assert word in message, message
    batch["tokens"] = tokens - 5
    with pytest.raises(DataError, match="negative token id -4"):
        get_batch_for_sp_rank(batch, 0, 1, 0, 7, vocab_size=100)


def test_pretrain_gpt_reports_a_data_error_raised_in_training(monkeypatch, capsys):
    """A `DataError` from a batch (and the warnings of parse_args) become one line each."""
    sys.path.insert(0, str(REPO_ROOT))
    import pretrain_gpt
    from megatron_ulysses.training import loop

    def bad_batch(config):
        raise DataError("the --data-path data holds token id 99, outside the tokenizer's "
                        "vocabulary of 64 ids")

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(loop, "pretrain", bad_batch)
    assert pretrain_gpt.main(BASE + ["--reset-position-ids"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("pretrain_gpt.py: warning: --reset-position-ids")
    assert err[1] == ("pretrain_gpt.py: error: the --data-path data holds token id 99, outside "
                      "the tokenizer's vocabulary of 64 ids")


def test_a_data_error_from_a_dataloader_worker_is_one_line(monkeypatch, capsys):
    """torch re-raises a worker's DataError with the worker's traceback in its message; the
    user gets the message it was raised with."""
    sys.path.insert(0, str(REPO_ROOT))
    import pretrain_gpt
    from torch._utils import ExceptionWrapper

    from megatron_ulysses.training import loop

    def bad_batch(config):
        try:
            raise DataError("--data-path chat.jsonl line 3: conversation 1 has no turns")
        except DataError:
            ExceptionWrapper(where="in DataLoader worker process 0").reraise()

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(loop, "pretrain", bad_batch)
    assert pretrain_gpt.main(BASE) == 2
    assert capsys.readouterr().err.splitlines() == [
        "pretrain_gpt.py: error: --data-path chat.jsonl line 3: conversation 1 has no turns"]


def test_token_ids_outside_the_vocabulary_end_the_run_with_one_message(files, tmp_path):
    result = run_cli([*MODEL, *RUN, "--data-path", files["d100"], "--split", "1",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "50"])
    assert_one_message(result, ["token id", "vocabulary of 51 ids", "--tokenizer-model",
                                "--vocab-size", f"(--data-path {files['d100']})"])
    assert re.search(r"token id (9\d)", result.stderr)


def test_data_made_with_another_tokenizer_of_the_same_vocabulary_is_refused(sp_model,
                                                                          corpus_prefix,
                                                                          tmp_path):
    """Its ids are all inside the vocabulary, so only the dataset's tokenizer record (written by
    tools/preprocess_data.py) tells that they stand for other text."""
    import shutil

    import train_tokenizer
    from conftest import CORPUS, TINY_VOCAB

    from megatron_ulysses.training.inputs import check_inputs

    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    (tmp_path / "half.jsonl").write_text("\n".join(lines[::2]) + "\n", encoding="utf-8")
    assert train_tokenizer.main(["--input", str(tmp_path / "half.jsonl"), "--output-prefix",
                                 str(tmp_path / "other"), "--vocab-size", str(TINY_VOCAB)]) == 0
    shutil.copyfile(sp_model, tmp_path / "copy.model")
    for suffix in (".bin", ".idx"):
        shutil.copyfile(corpus_prefix + suffix, str(tmp_path / "bare") + suffix)

    def check(model, prefix=corpus_prefix):
        check_inputs(parse_args([*MODEL, *RUN, "--data-path", prefix, "--split", "1",
                                 "--tokenizer-type", "GPTSentencePieceTokenizer",
                                 "--tokenizer-model", str(model)], world_size=1))

    check(sp_model)
    check(tmp_path / "copy.model")  # the same model elsewhere
    check(tmp_path / "other.model", str(tmp_path / "bare"))  # no record: nothing to compare
    with pytest.raises(ConfigError) as error:
        check(tmp_path / "other.model")
    message = str(error.value)
    assert "\n" not in message, message
    for words in [f"--data-path {corpus_prefix!r} was tokenized with GPTSentencePieceTokenizer "
                  f"{sp_model}", f"this run's tokenizer is GPTSentencePieceTokenizer "
                  f"{tmp_path / 'other.model'}", f"vocab size {TINY_VOCAB}",
                  "--tokenizer-model", "tools/preprocess_data.py",
                  f"delete {corpus_prefix}.tokenizer.json"]:
        assert words in message, (words, message)


@pytest.mark.parametrize("seq, sp, mbs, fused", [
    (699008, 1, 1, True),     # the 1B shape's qkv: 699008 x 3072 elements < 2^31
    (700000, 1, 1, False),    # past 2^31: TE's fused RoPE reads out of bounds (H200: illegal address)
    (1000064, 1, 1, False),   # the 1M-token example (NaN gradients with the fused kernel)
    (1000064, 2, 1, True),    # SP 2 halves the tokens per rank
    (524288, 1, 2, False),    # two sequences per micro batch count too
])
def test_rope_fusion_is_off_where_te_kernel_offsets_overflow(seq, sp, mbs, fused):
    from megatron_ulysses.training.arguments import build_parser, validate_args

    argv = ["--num-layers", "2", "--hidden-size", "2048", "--num-attention-heads", "32",
            "--group-query-attention", "--num-query-groups", "8", "--seq-length", str(seq),
            "--position-embedding-type", "rope", "--micro-batch-size", str(mbs), "--lr", "1e-3",
            "--train-iters", "1", "--mock-data", "--vocab-size", "64",
            "--ulysses-sp-size", str(sp), "--ulysses-attention-backend", "sdpa"]
    config = validate_args(build_parser().parse_args(argv), world_size=sp, cuda=True)
    assert config.model.no_rope_fusion is not fused
    said = [w for w in config.warnings if "RoPE runs unfused" in w]
    assert len(said) == (0 if fused else 1)
    if not fused:
        assert "--ulysses-sp-size" in said[0] and "--no-rope-fusion" in said[0]
        off = validate_args(build_parser().parse_args(argv + ["--no-rope-fusion"]),
                            world_size=sp, cuda=True)
        assert off.warnings == ()  # asked for: nothing to say
    on_cpu = validate_args(build_parser().parse_args(argv), world_size=sp, cuda=False)
    assert not on_cpu.model.no_rope_fusion and on_cpu.warnings == ()  # no fusion on CPU anyway


def test_an_unknown_flag_is_one_line_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + ["--micro-batch-sise", "2", "2", "8"], world_size=1)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # a typo: the close match is suggested
    assert err.count("\n") == 1 and "unrecognized arguments: --micro-batch-sise 2 2 8 (did " \
        "you mean --micro-batch-size" in err, err
    with pytest.raises(SystemExit):  # Megatron-LM's removed name: refused with its successor
        parse_args(BASE + ["--batch-size", "2"], world_size=1)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch-size: no longer valid in Megatron-LM either; " \
        "use --micro-batch-size" in err, err


@pytest.mark.parametrize("flags, replaced", [
    ([], []),
    (["--num-layers", "4", "--seq-length", "64"], []),  # shape flags: the command line wins
    (["--group-query-attention", "--num-query-groups", "2", "--rotary-base", "1000000",
      "--hidden-dropout", "0.0"],  # Megatron-LM's forced ones: the checkpoint's
     ["--group-query-attention True", "--num-query-groups 2", "--rotary-base 1000000",
      "--hidden-dropout 0.0"]),
])
def test_use_checkpoint_args_takes_what_megatron_lm_takes(flags, replaced, monkeypatch):
    """Megatron-LM's load_args_from_checkpoint: shape flags only where the command line gives
    none; query groups, RoPE base, dropout (its force=True list) over the command line's, one
    warning naming each value replaced."""
    from megatron_ulysses.training.checkpoint import load as checkpoint_load

    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "seq_length": 32,
             "num_query_groups": 8, "rotary_base": 500000, "hidden_dropout": 0.1}
    monkeypatch.setattr(checkpoint_load, "read_checkpoint_args", lambda path: saved)
    run = [*RUN, "--mock-data", "--vocab-size", "64"]
    config = parse_args(run + ["--load", "CKPT", "--use-checkpoint-args", *flags],
                        world_size=1)
    model = config.model
    assert (model.num_query_groups, model.rotary_base, model.hidden_dropout) == (8, 500000, 0.1)
    assert (model.num_layers, model.seq_length) == ((4, 64) if "--num-layers" in flags else
                                                    (2, 32))
    said = [w for w in config.warnings if "the checkpoint's values are used instead" in w]
    assert len(said) == (1 if replaced else 0), config.warnings
    for value in replaced:
        assert value in said[0], said
    if replaced:
        assert "--rotary-base 500000" in said[0] and "as Megatron-LM's" in said[0], said
