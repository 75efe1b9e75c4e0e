"""Passkey retrieval: a 5-digit number hidden in filler text at several depths of prompts of
several lengths (`prompt`); the score is how often the model's greedy answer is the number
(`greedy`).

`make_plan` turns the flags (pretrain_gpt.py's, plus --lengths, --depths, --trials and
--output-dir) into a `Plan`, checking everything before any process group exists: the trainer's
rules at every length, the checkpoint, the tokenizer and every prompt. `run` builds the model as
the trainer does (`training.model.build_model`), loads the weights as --finetune does
(`training.checkpoint.load.load_checkpoint`), answers every trial, and on rank 0 prints the table
and writes DIR/passkey.json and the heat map DIR/passkey.png (`results`).
"""

import copy
import math
import os
import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from ..sp import parallel_state as ps
from ..data.tokenizers import build_tokenizer_from
from ..errors import ConfigError
from ..training import arguments
from ..training.checkpoint.load import load_checkpoint
from ..training.checkpoint.state import read_tracker
from ..training.logging import print_rank_0
from ..training.loop import initialize_distributed
from ..training.model import build_model, transformer_config
from ..data.vocab import model_vocab_size
from .greedy import predict
from .prompt import PromptBuilder, make_key, too_short
from .results import format_table, summarize, write_results


@dataclass(frozen=True)
class Job:
    """One trial: a (length, depth) cell's `trial`-th prompt, whose passkey is `key`."""

    length: int
    depth: float
    trial: int
    key: int


@dataclass
class Plan:
    config: object  # the RunConfig (padded vocab set) the model is built from
    tokenizer: object
    builder: PromptBuilder
    lengths: List[int]
    depths: List[float]
    trials: int
    jobs: List[Job]
    output_dir: str
    load: str


# --- the plan: everything checked before a process group exists -----------------------------

def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _split(text: Optional[str], flag: str) -> List[str]:
    _require(text is not None and text.strip() != "", f"{flag} is required: a comma-separated "
             "list, e.g. " + ("--lengths 4096,16384" if flag == "--lengths" else
                              "--depths 0,0.5,1"))
    items = [item.strip() for item in text.split(",")]
    _require(all(items), f"{flag} {text!r} has an empty item; give comma-separated values")
    return items


def parse_lengths(text: Optional[str]) -> List[int]:
    """--lengths: distinct positive token counts."""
    lengths = []
    for item in _split(text, "--lengths"):
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"--lengths: {item!r} is not an integer number of tokens") from None
        _require(value > 0, f"--lengths: {value} is not a positive number of tokens")
        _require(value not in lengths, f"--lengths lists {value} twice")
        lengths.append(value)
    return lengths


def parse_depths(text: Optional[str]) -> List[float]:
    """--depths: distinct fractions of the filler in [0, 1]."""
    depths = []
    for item in _split(text, "--depths"):
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"--depths: {item!r} is not a number") from None
        _require(math.isfinite(value) and 0.0 <= value <= 1.0,
                 f"--depths: {item} is outside [0, 1] (0: the needle right after the "
                 "introduction, 1: right before the question)")
        _require(value not in depths, f"--depths lists {item} twice")
        depths.append(value)
    return depths


def _check_passkey_flags(args):
    """The flags the evaluation needs; returns (lengths, depths)."""
    _require(args.load is not None, "--load CKPT is required: the checkpoint to evaluate")
    _require(args.seq_length is None, "--seq-length is set from each --lengths value; drop it")
    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    _require(args.trials >= 1, f"--trials must be >= 1, got {args.trials}")
    _require(args.output_dir is not None, "--output-dir DIR is required: passkey.json and "
             "passkey.png are written there")
    _require(args.micro_batch_size >= 1,
             f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    return lengths, depths


def _check_checkpoint(args, given: frozenset) -> None:
    """--use-checkpoint-args takes the model's flags (and the tokenizer it names, as
    Megatron-LM's) from --load, as pretrain_gpt.py's (the shape where the command line's flags,
    `given`, have none: e.g. another TP); else a checkpoint must be there. The prompt is text: a text
    tokenizer is needed. The evaluation runs at PP 1 (a checkpoint of any pipeline layout loads
    there)."""
    if args.use_checkpoint_args:
        arguments.apply_checkpoint_args(args, given)  # and the tokenizer the checkpoint names
    elif read_tracker(args.load) is None:
        raise ConfigError(f"--load {args.load}: no checkpoint there (no "
                          "latest_checkpointed_iteration.txt)")
    _require(args.tokenizer_type not in (None, "NullTokenizer"),
             "--tokenizer-type: the passkey prompt is text; give the model's tokenizer "
             "(GPTSentencePieceTokenizer, SentencePieceTokenizer, HuggingFaceTokenizer or "
             "GPT2BPETokenizer) and its files")
    _require(args.pipeline_model_parallel_size == 1,
             f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: "
             "eval_passkey.py runs without pipeline parallelism; use 1 (a checkpoint saved at "
             "any pipeline layout loads at 1)")


def _check_lengths(args, lengths: List[int]) -> None:
    """Every prompt splits evenly over the ranks that hold its tokens and fits the model's
    learned absolute positions."""
    sp, tp = args.ulysses_sp_size, args.tensor_model_parallel_size
    if sp >= 1 and tp >= 1:  # else validate_args names the flag
        tp_split = args.sequence_parallel and tp > 1
        multiple = sp * (tp if tp_split else 1)
        what = (f"--ulysses-sp-size x --tensor-model-parallel-size ({sp} x {tp}, "
                "--sequence-parallel)" if tp_split else f"--ulysses-sp-size ({sp})")
        for length in lengths:
            _require(length % multiple == 0,
                     f"--lengths: {length} is not divisible by {what}: every rank holds an equal "
                     "share of the prompt, which is built to the exact length (never padded)")
    if args.position_embedding_type == "learned_absolute" and \
            args.max_position_embeddings is not None:
        for length in lengths:
            _require(length <= args.max_position_embeddings,
                     f"--lengths: {length} is longer than --max-position-embeddings "
                     f"({args.max_position_embeddings}) of the model's learned absolute "
                     "positions")


def _run_config(args, lengths: List[int], world_size: int):
    """The trainer's RunConfig, every rule checked at each length; that of the longest."""
    config = None
    for length in sorted(lengths):
        at_length = copy.copy(args)
        at_length.seq_length = length
        config = arguments.validate_args(at_length, world_size, torch.cuda.is_available())
    return config


def _tokenizer(args):
    try:
        return build_tokenizer_from(args)
    except (ValueError, ImportError, OSError, RuntimeError) as error:
        raise ConfigError(str(error)) from None


def make_plan(args, world_size: int, given: frozenset) -> Plan:
    """Check the parsed flags `args` (pretrain_gpt.py's that mean nothing here already reset;
    `given`: the flags on the command line, `arguments.given_flags`), the checkpoint's saved
    args, the tokenizer and every prompt, for `world_size` ranks; raises `ConfigError`."""
    lengths, depths = _check_passkey_flags(args)
    _check_checkpoint(args, given)
    _check_lengths(args, lengths)
    config = _run_config(args, lengths, world_size)
    arguments.check_writable_dir(args.output_dir, "--output-dir")
    tokenizer = _tokenizer(args)
    config = config.with_padded_vocab_size(model_vocab_size(  # as pretrain_gpt.py's
        tokenizer.vocab_size, config.model.padded_vocab_size,
        config.model.make_vocab_size_divisible_by, config.dims.tp, config.model.pad_vocab_size))
    builder = PromptBuilder(tokenizer)
    jobs = [Job(length, depth, trial, make_key(args.seed, length, depth, trial))
            for length in lengths for depth in depths for trial in range(args.trials)]
    for length in lengths:
        need = max(builder.shortest(job.key) for job in jobs if job.length == length)
        _require(length >= need, too_short(length, need))
    return Plan(config=config, tokenizer=tokenizer, builder=builder, lengths=lengths,
                depths=depths, trials=args.trials, jobs=jobs, output_dir=args.output_dir,
                load=args.load)


# --- the run --------------------------------------------------------------------------------

def _chunks(plan: Plan) -> List[List[Job]]:
    """Batches of at most --micro-batch-size trials of one (length, depth) cell."""
    size = plan.config.training.micro_batch_size
    cells = {}
    for job in plan.jobs:
        cells.setdefault((job.length, job.depth), []).append(job)
    return [jobs[i:i + size] for jobs in cells.values() for i in range(0, len(jobs), size)]


def _answer(plan: Plan, model, jobs: List[Job]) -> List[dict]:
    """The records of one batch of trials."""
    prompts = [plan.builder.build(job.length, job.depth, job.key) for job in jobs]
    predicted = predict(model, prompts, plan.tokenizer)
    return [{"length": job.length, "depth": job.depth, "trial": job.trial, "key": job.key,
             "needle_position": prompt.needle_start, "needle_depth": prompt.needle_depth,
             "answer_tokens": prompt.answer, "predicted_tokens": tokens,
             "predicted_text": plan.tokenizer.detokenize(tokens),
             "correct": tokens == prompt.answer}
            for job, prompt, tokens in zip(jobs, prompts, predicted)]


def evaluate(plan: Plan, model) -> Optional[List[dict]]:
    """Every trial's record, in the plan's order (on global rank 0; None elsewhere). The pure
    data-parallel ranks, if any, take every DP-th batch."""
    model.eval()
    dp_rank, dp = ps.get_pure_data_parallel_rank(), ps.get_pure_data_parallel_world_size()
    leader = ps.get_ulysses_sp_rank() == 0 and mpu.get_tensor_model_parallel_rank() == 0
    mine = _chunks(plan)[dp_rank::dp]
    records = []
    for index, jobs in enumerate(mine):
        start = time.time()
        records += _answer(plan, model, jobs)
        right = sum(record["correct"] for record in records[-len(jobs):])
        trials = (f"trial {jobs[0].trial}" if len(jobs) == 1 else
                  f"trials {jobs[0].trial}-{jobs[-1].trial}")
        print_rank_0(f" length {jobs[0].length:>8d} depth {jobs[0].depth:<5g} {trials}: "
                     f"{right}/{len(jobs)} correct ({time.time() - start:.1f} s; batch "
                     f"{index + 1}/{len(mine)} of data-parallel rank 0)")
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(records if leader else [], gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    order = {(job.length, job.depth, job.trial): i for i, job in enumerate(plan.jobs)}
    merged = sorted((r for part in gathered for r in part),
                    key=lambda r: order[(r["length"], r["depth"], r["trial"])])
    assert len(merged) == len(plan.jobs), (len(merged), len(plan.jobs))
    return merged


def run(plan: Plan) -> None:
    """Start the process groups, build and load the model, evaluate; rank 0 reports."""
    config = plan.config
    dims = config.dims
    initialize_distributed(config)
    print_rank_0(f" > world {dims.world_size} = TP {dims.tp} x PP {dims.pp} x DP {dims.dp} x "
                 f"Ulysses SP {dims.sp}; attention backend "
                 f"{config.model.ulysses_attention_backend}; lengths {plan.lengths}, depths "
                 f"{plan.depths}, {plan.trials} trials each")
    model = build_model(config.model, config.optimizer, config.training.seed,
                        transformer_config(config.model, dims))
    load_checkpoint(plan.load, model, None, None, config)  # --finetune: the weights only
    records = evaluate(plan, model)
    if records is None:
        return
    result = summarize(records, plan.lengths, plan.depths, plan.trials, plan.load,
                       read_tracker(plan.load))
    print(f"\npasskey retrieval of --load {plan.load} (iteration {result['iteration']}): "
          f"accuracy of the greedy answer over {plan.trials} trials per cell\n")
    print(format_table(result), flush=True)
    write_results(result, plan.output_dir)
    print(f"\n wrote {os.path.join(plan.output_dir, 'passkey.json')} and "
          f"{os.path.join(plan.output_dir, 'passkey.png')}", flush=True)
