"""Checkpoints with megatron-core `dist_checkpointing` (torch_dist): model, optimizer, LR scheduler,
every rank's RNG states, iteration, consumed samples and the model arguments.

Layout (Megatron-LM's): `<save>/iter_0000100/` and `<save>/latest_checkpointed_iteration.txt`.

Durability. A save goes to a job-unique `iter_0000100.tmp.<pid>-<random>/` (`save_guard`); when
every rank has written, each rank fsyncs the shard files it wrote (`__<rank>_*.distcp`) and rank 0
the other files and the directories, the ranks record every file's size and CRC-32
(`integrity.json`, checked before a load: `save_guard`); then rank 0 renames an existing
`iter_0000100/` aside (`.old`), renames the new one in, fsyncs `<save>`, replaces the tracker
(write, fsync, rename, fsync) and only then deletes the old directory. A
crash at any point leaves the tracker pointing at a complete checkpoint: in the one window where
`iter_0000100/` is missing (between the two renames) the loader takes `iter_0000100.old/`.

Safety: `--load` never runs code from the checkpoint: every file megatron-core would unpickle is
checked first by `trust.check_checkpoint_files` (see `trust`), and the loaded `_extra_state`
bytes by `trust.check_extra_states`.

RNG: each rank saves its own torch CPU, CUDA, megatron-core tracker, python `random` and numpy
states as tensors (one row per rank). A load with the same world size, TP, PP and SP restores each
rank's own; at another layout (another --ulysses-sp-size, data-parallel, tensor-parallel or
pipeline size) the RNG states are not restored: the run keeps the streams seeded from --seed, and
rank 0 says so.

Model tensors are stored unsharded-by-layout (megatron-core's global keys and shapes; its
dist_checkpointing reshards them on load), so a run can resume with another `--ulysses-sp-size`,
data-parallel size, TP size, pipeline size or virtual pipeline, its Adam moments too (they are
sharded as their parameters). The padded vocabulary must match: it depends on TP
(`load.check_args` names --padded-vocab-size).

--async-save: the files are written by megatron-core's async writer and the steps after the
write (fsync, record, rename, tracker, --save-retain-interval) are its request's finalize step
(`saver`), so the tracker still moves last.

Megatron-LM's torch_dist checkpoints load too (`megatron_lm` maps their common
state onto ours): the model at any SP size and pipeline layout (a virtual pipeline's `model0`,
`model1`, ... included), its LR schedule, iteration and consumed samples; RNG states restart
from --seed.

Modules: `state` (what a checkpoint holds besides tensors: tracker, format, saved args), `save`,
`load`, `rng_state` (per-rank RNG tensors), `save_guard` (the --save lock, staging, integrity
record), `saver` (what persists between saves: strategy, async queue), `trust` (the pickle
scan), `megatron_lm` (Megatron-LM's common state mapped onto ours).
"""
