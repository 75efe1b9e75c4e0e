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

Rank 0 prints a markdown table (a row per length, a column per depth, the mean) and writes
DIR/passkey.json and the heat map DIR/passkey.png. The evaluation is `megatron_ulysses.eval`:
the prompt (`eval/prompt.py`), the greedy answer by one teacher-forced forward sharded over the
SP ranks (`eval/greedy.py`), the plan and the run (`eval/passkey.py`).
"""

import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ulysses.errors import ConfigError  # noqa: E402
from megatron_ulysses.eval.passkey import Plan, make_plan, run  # noqa: E402
from megatron_ulysses.training import arguments  # noqa: E402
from megatron_ulysses.training.cli import (  # noqa: E402
    report_error,
    run_distributed,
    say_warnings,
)

PROG = "eval_passkey.py"

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
    "lr_warmup_samples": None, "lr_decay_samples": None, "lr_warmup_init": None,
    "lr_wsd_decay_iters": None, "lr_wsd_decay_samples": None, "decoupled_lr": None,
    "decoupled_min_lr": None, "start_weight_decay": None, "end_weight_decay": None,
    "weight_decay_incr_style": None, "rampup_batch_size": None, "step_batch_size_schedule": None,
    "eval_micro_batch_size": None, "eval_global_batch_size": None, "profile": False,
    "check_weight_hash_across_dp_replicas_interval": None,
}


def build_parser(model_flags_required: bool = True) -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser (`model_flags_required=False` with --use-checkpoint-args) with
    the passkey flags; --seq-length comes from --lengths."""
    parser = arguments.build_parser(model_flags_required)
    parser.prog = PROG
    parser.description = __doc__.split("\n\n")[0]
    for _, _, action in parser.flags():
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


def parse(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Plan:
    """Parse the flags into the checked `Plan`; raises `ConfigError` (argparse errors exit 2)."""
    raw = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    parser = build_parser(model_flags_required="--use-checkpoint-args" not in raw)
    args = parser.parse_args(raw)
    for name, value in _TRAINING_ONLY.items():
        setattr(args, name, parser.get_default(name) if value is None else value)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return make_plan(args, world_size, arguments.given_flags(raw))


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        plan = parse(argv)
        say_warnings(PROG, plan.config.warnings)
    except ConfigError as error:
        return report_error(PROG, error)
    return run_distributed(PROG, lambda: run(plan))


if __name__ == "__main__":
    sys.exit(main())
