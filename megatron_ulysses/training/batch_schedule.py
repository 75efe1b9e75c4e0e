"""The global batch size as a pure function of the samples consumed: Megatron-LM's
`--rampup-batch-size` (megatron-core 0.16's RampupBatchsizeNumMicroBatchesCalculator) and
`--step-batch-size-schedule` (0.19's StepBatchsizeNumMicroBatchesCalculator), the same on every
megatron-core version.

    consumed samples --global_batch_size_at--> global batch --/ (micro x pure DP)--> micro batches

Every iteration reads the data stream on from `consumed`, so a changing batch size needs nothing
from the sampler, and a resume at `consumed` continues the ramp where it was.
"""

from typing import Optional, Tuple

Schedule = Tuple[Tuple[int, int], ...]  # (first consumed sample, global batch size), ascending

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _count(text: str) -> int:
    """'250B' -> 250_000_000_000 (Megatron-LM's K/M/B/T suffixes)."""
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if multiplier > 1 else text) * multiplier)


def parse_step_schedule(text: str, seq_length: int) -> Schedule:
    """`--step-batch-size-schedule 'THRESHOLD:BS ...'`, thresholds in tokens (pretrain passes
    --seq-length, as Megatron-LM's) -> ((samples, batch size), ...). Raises ValueError."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        if not sep:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        try:
            steps.append((_count(threshold) // seq_length, _count(batch)))
        except ValueError:
            raise ValueError(f"entry {entry!r}: expected numbers (K/M/B/T suffixes)") from None
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ValueError("the first entry must start at threshold 0")
    for (before, _), (after, _) in zip(steps, steps[1:]):
        if after <= before:
            raise ValueError(f"thresholds must increase (in samples of --seq-length {seq_length}"
                             f" tokens), got {before} then {after}")
    return tuple(steps)


def rampup_schedule(rampup: Tuple[int, int, int], final: int) -> Schedule:
    """`--rampup-batch-size START INCREMENT SAMPLES` up to `final` (--global-batch-size) as
    steps: batch START + k x INCREMENT from sample ceil(k x SAMPLES / n) (n increments), `final`
    from SAMPLES on -- megatron-core's `int(consumed / (SAMPLES / n))` made exact."""
    start, increment, samples = rampup
    n = (final - start) // increment
    if n == 0:
        return ((0, final),)
    return tuple((-(-k * samples // n), start + k * increment) for k in range(n + 1))


def global_batch_size_at(consumed: int, schedule: Optional[Schedule], default: int) -> int:
    """The global batch size of the iteration that starts after `consumed` samples."""
    if not schedule:
        return default
    size = schedule[0][1]
    for threshold, batch in schedule:
        if consumed < threshold:
            break
        size = batch
    return size


def iterations_for(samples: int, schedule: Optional[Schedule], default: int) -> int:
    """--train-samples in iterations: the constant batch's floor (Megatron-LM); under a
    schedule, iterations until `samples` are consumed (its update_train_iters)."""
    if not schedule:
        return samples // default
    iterations = consumed = 0
    while consumed < samples:
        consumed += global_batch_size_at(consumed, schedule, default)
        iterations += 1
    return iterations


def samples_after(iterations: int, schedule: Optional[Schedule], default: int) -> int:
    """The samples `iterations` iterations consume from the start."""
    if not schedule:
        return iterations * default
    consumed = 0
    for _ in range(iterations):
        consumed += global_batch_size_at(consumed, schedule, default)
    return consumed


def batch_sizes(schedule: Optional[Schedule], default: int):
    """Every global batch size the run can take."""
    return sorted({batch for _, batch in schedule}) if schedule else [default]

