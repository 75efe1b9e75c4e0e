"""The parallelism section: Ulysses SP, TP and PP sizes -> the run's `ParallelDims` (the
`RunConfig.dims`; the flags that tune one parallelism's work live with what they tune:
--sequence-parallel in `model`, the distributed optimizer in `optimizer`, the process group's
backend in `training`)."""

from ...errors import ConfigError
from ...parallel_state import ParallelDims
from .checks import Context, require


def add_arguments(parser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--ulysses-sp-size", type=int, default=1,
                   help="Ulysses SP size P: one sequence is split over P ranks (taken out of "
                   "data parallelism); SP rank r gets ceil or floor of (heads / TP) / P "
                   "heads, so P may be up to --num-attention-heads / TP.")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)


def parallel_dims(args, world_size: int) -> ParallelDims:
    """The sizes must be >= 1 and their product divide `world_size`, the number of processes."""
    try:
        return ParallelDims(world_size=world_size, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, sp=args.ulysses_sp_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def validate(args, ctx: Context) -> None:
    require(ctx.cuda or ctx.dims.pp == 1,
            f"--pipeline-model-parallel-size {ctx.dims.pp} needs CUDA (megatron-core's "
            "pipeline schedules); use 1 on CPU")
