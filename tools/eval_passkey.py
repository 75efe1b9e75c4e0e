"""Passkey retrieval: a 5-digit number hidden in filler text at several depths of prompts of
several lengths; the score is how often the model's greedy answer is the number.

    torchrun --nproc-per-node N tools/eval_passkey.py --load CKPT --use-checkpoint-args \\
        --ulysses-sp-size N --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model TOK \\
        --lengths 4096,16384,65536 --depths 0,0.25,0.5,0.75,1 --trials 5 --output-dir DIR

The flags are pretrain_gpt.py's (Megatron-LM names) plus --lengths, --depths, --trials and
--output-dir; the model, parallelism, tokenizer and --seed ones are used, training ones (data,
optimizer, schedule, --save, ...) are accepted and ignored, so a training command line works with
the passkey flags added. --micro-batch-size is the number of trials per forward (default 1).
Every bad flag exits 2 with one message naming it, before any process group exists.

The prompt (the standard passkey test), tokenized to exactly the length asked for, answer
included (the filler is trimmed, never padded):

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize it.
    I will quiz you about the important information there. <filler> The pass key is KEY.
    Remember it. KEY is the pass key. <filler> What is the pass key? The pass key is KEY

The filler repeats "The grass is green. The sky is blue. The sun is yellow. Here we go. There
and back again."; the needle sits at the sentence boundary nearest to depth d of the filler
(0: right after the introduction, 1: right before the question). KEY is drawn from --seed per
(length, depth, trial).

Greedy answer without a generation loop: greedy decoding emits answer token t_i iff t_i is the
argmax of the logits after the prompt and t_1..t_{i-1}. So the greedy answer starts with the key's
tokens (the answer is correct) iff at every answer position the argmax given the *correct* prefix
is the key's token, which one teacher-forced forward over prompt + answer decides for all
positions at once (once one position is wrong, the later ones do not matter: the answer is wrong
either way). The argmax is over the tokenizer's ids (the padded vocabulary rows are not tokens);
ties go to the lowest id, as torch.argmax. Correct means token-exact: the key's tokens as a
continuation of the question (a model that spells the digits with other tokens is counted wrong,
as a greedy generation compared token by token would be).

The forward is the trainer's: the model is built by `training.model.build_model` and loaded by
`training.checkpointing.load_checkpoint` (weights only, as --finetune); each batch is sharded as
training shards it (`data.sharding.get_batch_for_sp_rank`), so every SP rank holds s/P tokens.
Only the answer positions go through the output layer (as megatron-core's own inference path
does for the last token), so no [s/P, V] logits exist; the argmax over the TP-sharded vocabulary
is taken per rank and compared over TP, the answer tokens are combined over the SP group, and
rank 0 writes the table (stdout), DIR/passkey.json and the heat map DIR/passkey.png.
"""

import argparse
import contextlib
import copy
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_ulysses.training import arguments  # noqa: E402
from megatron_ulysses.training.arguments import ConfigError  # noqa: E402
from megatron_ulysses.training.cli import (  # noqa: E402
    report_error,
    run_distributed,
    say_warnings,
)

PROG = "eval_passkey.py"

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
ANCHOR = "."  # what a continuation is tokenized after (see PromptBuilder.continuation)

# pretrain_gpt.py flags that mean nothing here: reset to these values (None: the parser's
# default), so that a training command line validates as an evaluation.
_TRAINING_ONLY = {
    "global_batch_size": None, "lr": 0.0, "min_lr": 0.0, "lr_decay_style": None,
    "lr_warmup_iters": 0, "lr_warmup_fraction": None, "lr_decay_iters": None,
    "weight_decay": None, "adam_beta1": None, "adam_beta2": None, "adam_eps": None,
    "clip_grad": None, "override_opt_param_scheduler": False,
    "use_checkpoint_opt_param_scheduler": False, "loss_scale": None, "initial_loss_scale": None,
    "min_loss_scale": None, "loss_scale_window": None, "hysteresis": None,
    "use_distributed_optimizer": False, "overlap_grad_reduce": False,
    "train_iters": 1, "train_samples": None, "eval_interval": None, "eval_iters": 0,
    "log_interval": None, "exit_interval": None, "exit_signal_handler": False,
    "tensorboard_dir": None, "data_path": None, "split": None, "mock_data": True,
    "data_cache_path": None, "num_workers": 0, "reset_position_ids": False,
    "reset_attention_mask": False, "eod_mask_loss": False, "save": None,
    "save_interval": None, "no_load_optim": True, "finetune": True,
    "offload_activations": False, "skip_train": False,
}


# --- flags ----------------------------------------------------------------------------------

def build_parser(model_flags_required: bool = True) -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser (`model_flags_required=False` with --use-checkpoint-args) with
    the passkey flags; --seq-length comes from --lengths."""
    parser = arguments.build_parser(model_flags_required)
    parser.prog = PROG
    parser.description = __doc__.split("\n\n")[0]
    for action in parser._actions:
        if action.dest == "seq_length":
            action.required, action.help = False, "set from each --lengths value; not given"
        elif action.dest == "micro_batch_size":
            action.required, action.default = False, 1
            action.help = "trials per forward (default 1)"
        elif action.dest == "lr":
            action.required, action.default = False, 0.0
            action.help = "not used"
        elif action.dest == "seed":
            action.help = "the passkeys are drawn from it (default 1234)"
        elif action.dest == "load":
            action.help = "the checkpoint to evaluate (required; loaded as with --finetune)"
    g = parser.add_argument_group("passkey retrieval")
    g.add_argument("--lengths", type=str, default=None,
                   help="prompt lengths in tokens (answer included), comma separated, e.g. "
                   "4096,16384; each must divide by --ulysses-sp-size (x TP with "
                   "--sequence-parallel)")
    g.add_argument("--depths", type=str, default="0,0.25,0.5,0.75,1",
                   help="needle depths in [0, 1], comma separated (default %(default)s)")
    g.add_argument("--trials", type=int, default=5,
                   help="prompts (keys) per length and depth (default %(default)s)")
    g.add_argument("--output-dir", type=str, default=None,
                   help="where passkey.json and passkey.png are written")
    return parser


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


# --- the prompt -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One trial: a (length, depth) cell's `trial`-th prompt, whose passkey is `key`."""

    length: int
    depth: float
    trial: int
    key: int


@dataclass(frozen=True)
class Prompt:
    tokens: List[int]  # prompt + answer, exactly the requested length
    answer: List[int]  # the last len(answer) tokens: the key after "The pass key is"
    needle_start: int  # token index of the needle
    needle_end: int
    needle_depth: float  # where in the filler it actually sits (a sentence boundary)


def make_key(seed: int, length: int, depth: float, trial: int) -> int:
    """The 5-digit passkey of one trial; the same for every rank and layout."""
    return random.Random(f"passkey/{seed}/{length}/{depth!r}/{trial}").randint(10000, 99999)


class PromptBuilder:
    """Token-level prompts of an exact length. Each part is tokenized once, as it reads in
    running text (`continuation`), and the parts are concatenated, so the length is exact and the
    filler can be cut anywhere."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.intro = list(tokenizer.tokenize(INTRO))
        self.sentences = [self.continuation(sentence) for sentence in FILLER]
        self.question = self.continuation(QUESTION)
        _require(self.intro and all(self.sentences) and self.question,
                 "--tokenizer-model encodes the passkey prompt's text to no tokens")

    def continuation(self, text: str) -> List[int]:
        """The tokens of `text` after a sentence and a space: tokenized behind an anchor that
        is then cut off, so that word-initial forms (sentencepiece's "▁", byte-level BPE's
        leading space) are those of running text; tokenized with a leading space when the
        anchor does not tokenize as a prefix."""
        anchor = list(self.tokenizer.tokenize(ANCHOR))
        joined = list(self.tokenizer.tokenize(f"{ANCHOR} {text}"))
        if joined[:len(anchor)] == anchor and len(joined) > len(anchor):
            return joined[len(anchor):]
        return list(self.tokenizer.tokenize(f" {text}"))

    def parts(self, key: int):
        return self.continuation(NEEDLE.format(key=key)), self.continuation(str(key))

    def shortest(self, key: int) -> int:
        """The length of the prompt without filler."""
        needle, answer = self.parts(key)
        return len(self.intro) + len(needle) + len(self.question) + len(answer)

    def build(self, length: int, depth: float, key: int) -> Prompt:
        needle, answer = self.parts(key)
        budget = length - self.shortest(key)
        _require(budget >= 0, f"--lengths: {length} tokens are too few for the passkey prompt, "
                 f"which needs {self.shortest(key)} without any filler with this tokenizer")
        filler, boundaries, index = [], [0], 0
        while len(filler) < budget:
            sentence = self.sentences[index % len(self.sentences)]
            index += 1
            filler.extend(sentence[:budget - len(filler)])  # the last one may be cut
            boundaries.append(len(filler))
        cut = min(boundaries, key=lambda b: (abs(b - depth * budget), b))
        start = len(self.intro) + cut
        tokens = self.intro + filler[:cut] + needle + filler[cut:] + self.question + answer
        assert len(tokens) == length
        return Prompt(tokens=tokens, answer=answer, needle_start=start,
                      needle_end=start + len(needle),
                      needle_depth=cut / budget if budget else 0.0)


# --- the plan: everything checked before a process group exists -----------------------------

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


def parse(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Plan:
    """Parse and check the flags, the checkpoint's saved args, the tokenizer and every prompt;
    raises `ConfigError` (argparse errors exit 2)."""
    from megatron_ulysses.data.tokenizers import build_tokenizer_from
    from megatron_ulysses.training.checkpointing import read_tracker

    raw = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    parser = build_parser(model_flags_required="--use-checkpoint-args" not in raw)
    args = parser.parse_args(raw)
    _require(args.load is not None, "--load CKPT is required: the checkpoint to evaluate")
    _require(args.seq_length is None, "--seq-length is set from each --lengths value; drop it")
    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    _require(args.trials >= 1, f"--trials must be >= 1, got {args.trials}")
    _require(args.output_dir is not None, "--output-dir DIR is required: passkey.json and "
             "passkey.png are written there")
    _require(args.tokenizer_type not in (None, "NullTokenizer"),
             "--tokenizer-type: the passkey prompt is text; give the model's tokenizer "
             "(GPTSentencePieceTokenizer, SentencePieceTokenizer, HuggingFaceTokenizer or "
             "GPT2BPETokenizer) and its files")
    _require(args.micro_batch_size >= 1,
             f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    for name, value in _TRAINING_ONLY.items():
        setattr(args, name, parser.get_default(name) if value is None else value)
    if args.use_checkpoint_args:
        arguments.apply_checkpoint_args(args)
    elif read_tracker(args.load) is None:
        raise ConfigError(f"--load {args.load}: no checkpoint there (no "
                          "latest_checkpointed_iteration.txt)")
    _require(args.pipeline_model_parallel_size == 1,
             f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: "
             f"{PROG} runs without pipeline parallelism; use 1 (a checkpoint saved at PP > 1 "
             "cannot be evaluated yet)")

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

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = None
    for length in sorted(lengths):  # every rule of the trainer at each length
        at_length = copy.copy(args)
        at_length.seq_length = length
        config = arguments.validate_args(at_length, world_size, torch.cuda.is_available())
    arguments.check_writable_dir(args.output_dir, "--output-dir")

    try:
        tokenizer = build_tokenizer_from(args)
    except (ValueError, ImportError, OSError, RuntimeError) as error:
        raise ConfigError(str(error)) from None
    config = config.with_padded_vocab_size(arguments.padded_vocab_size(
        tokenizer.vocab_size, config.model.make_vocab_size_divisible_by, config.dims.tp))
    builder = PromptBuilder(tokenizer)
    jobs = [Job(length, depth, trial, make_key(args.seed, length, depth, trial))
            for length in lengths for depth in depths for trial in range(args.trials)]
    for length in lengths:
        need = max(builder.shortest(job.key) for job in jobs if job.length == length)
        _require(length >= need, f"--lengths: {length} tokens are too few for the passkey "
                 f"prompt, which needs {need} without any filler with this tokenizer")
    return Plan(config=config, tokenizer=tokenizer, builder=builder, lengths=lengths,
                depths=depths, trials=args.trials, jobs=jobs, output_dir=args.output_dir,
                load=args.load)


# --- the forward ----------------------------------------------------------------------------

def _gpt_model(model):
    from megatron.core.models.gpt import GPTModel

    return next(module for module in model.modules() if isinstance(module, GPTModel))


@contextlib.contextmanager
def output_layer_positions(gpt, positions: torch.Tensor):
    """Within: `gpt`'s output layer sees only the decoder's hidden states at `positions` (this
    rank's s/P coordinates), so the logits are [b, len(positions), V/TP]. Under
    --sequence-parallel the hidden states are first gathered over TP and the output layer's
    sequence gather is off, as in megatron-core's GPTModel for the last token in inference."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    output_layer = gpt.output_layer
    sequence_parallel = output_layer.sequence_parallel

    def select(hidden):
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, group=mpu.get_tensor_model_parallel_group())
        return hidden.index_select(0, positions)

    def hook(module, inputs, output):
        if isinstance(output, tuple):  # 0.19 may return (hidden, intermediate hidden states)
            return (select(output[0]),) + tuple(output[1:])
        return select(output)

    handle = gpt.decoder.register_forward_hook(hook)
    output_layer.sequence_parallel = False
    try:
        yield
    finally:
        handle.remove()
        output_layer.sequence_parallel = sequence_parallel


def vocab_parallel_argmax(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Argmax ids `[...]` of this TP rank's logits `[..., V/TP]` over the whole vocabulary's
    first `vocab_size` ids (the padded rows are not tokens); ties go to the lowest id."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    local = logits.shape[-1]
    offset = mpu.get_tensor_model_parallel_rank() * local
    ids = torch.arange(offset, offset + local, device=logits.device)
    values, index = logits.float().masked_fill(ids >= vocab_size, float("-inf")).max(dim=-1)
    index = index + offset  # torch.max gives the first of equal maxima
    tp = mpu.get_tensor_model_parallel_world_size()
    if tp == 1:
        return index
    group = mpu.get_tensor_model_parallel_group()
    all_values = [torch.empty_like(values) for _ in range(tp)]
    all_index = [torch.empty_like(index) for _ in range(tp)]
    dist.all_gather(all_values, values.contiguous(), group=group)
    dist.all_gather(all_index, index.contiguous(), group=group)
    best = torch.stack(all_values).argmax(dim=0, keepdim=True)  # the first (lowest id) of ties
    return torch.stack(all_index).gather(0, best).squeeze(0)


def predict(model, prompts: List[Prompt], tokenizer) -> List[List[int]]:
    """The greedy (teacher-forced) token at every answer position of each prompt, one forward
    of the batch sharded over the SP group; the same lists on every rank of the group."""
    import torch.distributed as dist

    from megatron_ulysses import cpu_compat
    from megatron_ulysses import parallel_state as ps
    from megatron_ulysses.data.sharding import get_batch_for_sp_rank
    from megatron_ulysses.data.tokenizers import padding_id

    length = len(prompts[0].tokens)
    tokens = torch.tensor([p.tokens for p in prompts], dtype=torch.long)
    pad = padding_id(tokenizer)
    labels = torch.cat([tokens[:, 1:], torch.full((len(prompts), 1), pad)], dim=1)
    answer_mask = torch.zeros_like(tokens, dtype=torch.float)  # positions that predict answers
    for row, prompt in enumerate(prompts):
        answer_mask[row, length - len(prompt.answer) - 1:length - 1] = 1
    sample = {"tokens": tokens, "labels": labels, "loss_mask": answer_mask,
              "position_ids": torch.arange(length).expand_as(tokens).contiguous()}
    sp_rank, sp = ps.get_ulysses_sp_rank(), ps.get_ulysses_sp_world_size()
    local = get_batch_for_sp_rank(sample, sp_rank, sp, pad_id=pad, eod_id=tokenizer.eod,
                                  vocab_size=tokenizer.vocab_size)
    local_mask = local["loss_mask"].bool()  # [b, s/P]
    columns = local_mask.any(dim=0).nonzero().squeeze(1)
    if columns.numel() == 0:  # no answer here; one column keeps every kernel's shape usual
        columns = torch.zeros(1, dtype=torch.long)
    device = cpu_compat.device()
    with torch.no_grad(), output_layer_positions(_gpt_model(model), columns.to(device)):
        logits = model(local["tokens"].to(device), local["position_ids"].to(device), None)
    chosen = vocab_parallel_argmax(logits, tokenizer.vocab_size).cpu()  # [b, len(columns)]

    width = max(len(p.answer) for p in prompts)
    answers = torch.full((len(prompts), width), -1, dtype=torch.long)
    first_global = sp_rank * local_mask.shape[1]
    for row, prompt in enumerate(prompts):
        start = length - len(prompt.answer) - 1  # the position that predicts answer token 0
        for j, column in enumerate(columns.tolist()):
            if local_mask[row, column]:
                answers[row, first_global + column - start] = chosen[row, j]
    answers = answers.to(device)
    dist.all_reduce(answers, op=dist.ReduceOp.MAX, group=ps.get_ulysses_sp_group())
    return [answers[row, :len(p.answer)].tolist() for row, p in enumerate(prompts)]


def _chunks(plan: Plan):
    """Batches of at most --micro-batch-size trials of one (length, depth) cell."""
    size = plan.config.training.micro_batch_size
    cells = {}
    for job in plan.jobs:
        cells.setdefault((job.length, job.depth), []).append(job)
    return [jobs[i:i + size] for jobs in cells.values() for i in range(0, len(jobs), size)]


def evaluate(plan: Plan, model) -> Optional[List[dict]]:
    """Every trial's record (on global rank 0; None elsewhere). The pure data-parallel ranks,
    if any, take every DP-th batch."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_ulysses import parallel_state as ps
    from megatron_ulysses.training.logging import print_rank_0

    model.eval()
    dp_rank, dp = ps.get_pure_data_parallel_rank(), ps.get_pure_data_parallel_world_size()
    leader = ps.get_ulysses_sp_rank() == 0 and mpu.get_tensor_model_parallel_rank() == 0
    chunks = _chunks(plan)
    mine = chunks[dp_rank::dp]
    records = []
    for index, jobs in enumerate(mine):
        start = time.time()
        prompts = [plan.builder.build(job.length, job.depth, job.key) for job in jobs]
        predicted = predict(model, prompts, plan.tokenizer)
        for job, prompt, tokens in zip(jobs, prompts, predicted):
            records.append({
                "length": job.length, "depth": job.depth, "trial": job.trial, "key": job.key,
                "needle_position": prompt.needle_start, "needle_depth": prompt.needle_depth,
                "answer_tokens": prompt.answer, "predicted_tokens": tokens,
                "predicted_text": plan.tokenizer.detokenize(tokens),
                "correct": tokens == prompt.answer,
            })
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


# --- results --------------------------------------------------------------------------------

def summarize(plan: Plan, records: List[dict], iteration: Optional[int]) -> dict:
    accuracy = [[sum(r["correct"] for r in records if r["length"] == length
                     and r["depth"] == depth) / plan.trials for depth in plan.depths]
                for length in plan.lengths]
    return {"load": plan.load, "iteration": iteration, "lengths": plan.lengths,
            "depths": plan.depths, "trials": plan.trials, "accuracy": accuracy,
            "mean": [sum(row) / len(row) for row in accuracy], "records": records}


def format_table(result: dict) -> str:
    """Markdown: a row per length, a column per depth (accuracy over the trials), the mean."""
    header = ["length"] + [f"depth {depth:g}" for depth in result["depths"]] + ["mean"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for length, row, mean in zip(result["lengths"], result["accuracy"], result["mean"]):
        lines.append("| " + " | ".join([str(length)] + [f"{a:.3f}" for a in row + [mean]])
                     + " |")
    return "\n".join(lines)


def plot_heatmap(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths = result["lengths"], result["depths"]
    grid = [[result["accuracy"][i][j] for i in range(len(lengths))] for j in range(len(depths))]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(lengths) + 2.5),
                                    max(3.0, 0.5 * len(depths) + 2.0)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_yticks(range(len(depths)), [f"{depth:g}" for depth in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    for j in range(len(depths)):
        for i in range(len(lengths)):
            ax.text(i, j, f"{grid[j][i]:.2f}", ha="center", va="center", fontsize=9)
    fig.colorbar(image, ax=ax, label=f"accuracy ({result['trials']} trials)")
    ax.set_title(f"passkey retrieval: {os.path.basename(os.path.normpath(result['load']))}"
                 f" (iteration {result['iteration']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(result: dict, output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "passkey.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    plot_heatmap(result, os.path.join(output_dir, "passkey.png"))


# --- main -----------------------------------------------------------------------------------

def run(plan: Plan) -> None:
    from megatron_ulysses.training.checkpointing import load_checkpoint, read_tracker
    from megatron_ulysses.training.logging import print_rank_0
    from megatron_ulysses.training.loop import initialize_distributed
    from megatron_ulysses.training.model import build_model, transformer_config

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
    result = summarize(plan, records, read_tracker(plan.load))
    print(f"\npasskey retrieval of --load {plan.load} (iteration {result['iteration']}): "
          f"accuracy of the greedy answer over {plan.trials} trials per cell\n")
    print(format_table(result), flush=True)
    write_results(result, plan.output_dir)
    print(f"\n wrote {os.path.join(plan.output_dir, 'passkey.json')} and "
          f"{os.path.join(plan.output_dir, 'passkey.png')}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        plan = parse(argv)
        say_warnings(PROG, plan.config.warnings)
    except ConfigError as error:
        return report_error(PROG, error)
    return run_distributed(PROG, lambda: run(plan))


if __name__ == "__main__":
    sys.exit(main())
