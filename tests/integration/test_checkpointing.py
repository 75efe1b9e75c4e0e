"""Checkpoints (`megatron_ulysses.training.checkpoint`): safety, per-rank RNG, durability and
`--load` validation. save/load run in-process on gloo workers (CPU, a tiny GPTModel); two cases
go through pretrain_gpt.py to see the user's message.

- A malicious checkpoint (a pickled `os.system` payload in common.pt, in the DCP `.metadata`,
  in an RNG ShardedObject or in a layer's `_extra_state` bytes) is refused with one message
  naming --load and the file, and the payload never runs (it would create a marker file).
- Every rank saves its own RNG states (python, numpy, torch, every tracker stream) and gets them
  back at the same layout; at another SP x DP layout or TP size they are left as seeded and
  rank 0 warns; at another TP size each rank loads its block of every weight.
- Shard files and directories are fsynced before the rename and the tracker update; a writer
  killed between renaming the old iteration aside and the new one in leaves the tracker
  pointing at a loadable checkpoint (the old one), and the next save cleans up.
- A garbage tracker, a tracker naming a missing directory, another model shape (hidden size,
  qk layernorm, positions, rotary percent, ...) and --train-iters below the checkpoint's
  iteration are one clear `ConfigError` each.
"""

import contextlib
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed import spawn

from megatron_ulysses.errors import ConfigError

SAVED_AT, CONSUMED = 3, 12
BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--lr", "1e-3", "--train-iters", "8", "--mock-data", "--vocab-size", "64",
        "--attention-dropout", "0", "--hidden-dropout", "0"]
ROPE = ["--position-embedding-type", "rope"]


# --- worker helpers (run inside gloo workers) ---------------------------------------------------

def build_run(argv, world: int):
    """config, model, optimizer, scheduler of `argv` as pretrain() builds them, on an existing
    gloo group (the optimizer without Adam states yet)."""
    from megatron_ulysses import cpu_compat
    from megatron_ulysses.sp import parallel_state as ps
    from megatron_ulysses.training import model as builders
    from megatron_ulysses.training.arguments import padded_vocab_size, parse_args
    from megatron_ulysses.training.optimizer import build_optimizer

    cpu_compat.install()
    config = parse_args(list(argv), world_size=world)
    config = config.with_padded_vocab_size(padded_vocab_size(
        config.data.vocab_size, config.model.make_vocab_size_divisible_by, config.dims.tp))
    ps.initialize_model_parallel(dims=config.dims, virtual_pipeline_model_parallel_size=(
        config.model.virtual_pipeline_model_parallel_size))
    cpu_compat.model_parallel_manual_seed(config.training.seed)
    model = builders.build_model(config.model, config.optimizer, config.training.seed,
                                 builders.transformer_config(config.model, config.dims))
    optimizer = build_optimizer(config.optimizer, config.model, model)
    return config, model, optimizer, builders.build_scheduler(config.optimizer, optimizer)


def _build(world: int, *flags: str):
    """`build_run` of BASE + `flags`, its Adam states made as in a checkpoint of a real run."""
    config, model, optimizer, scheduler = build_run(BASE + list(flags), world)
    optimizer.step()  # zero gradients: Adam states exist
    return config, model, optimizer, scheduler


def _teardown():
    from megatron_ulysses.sp import parallel_state as ps

    ps.destroy_model_parallel()


def _weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _shift_weights(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _assert_weights(model, expected: dict) -> None:
    got = _weights(model)
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name


def _save(root, build, iteration=SAVED_AT):
    from megatron_ulysses.training.checkpoint.save import save_checkpoint

    args, model, optimizer, scheduler = build
    save_checkpoint(root, iteration, model, optimizer, scheduler, args, CONSUMED)


def _load(root, build):
    """load_checkpoint's result and what it printed."""
    from megatron_ulysses.training.checkpoint.load import load_checkpoint

    args, model, optimizer, scheduler = build
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = load_checkpoint(root, model, optimizer, scheduler, args)
    return result, out.getvalue()


def _scramble(seed: int) -> None:
    """Move every RNG stream to a state that depends on `seed`, with cached gaussians."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    random.gauss(0, 1)
    np.random.seed(seed + 1)
    np.random.standard_normal()
    torch.manual_seed(seed + 2)
    torch.rand(3)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    for offset, name in enumerate(sorted(tracker.get_states())):
        with tracker.fork(name):
            torch.manual_seed(seed + 3 + offset)
            torch.rand(2)


def _rng_snapshot() -> dict:
    from megatron.core import tensor_parallel

    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (keys.tolist(), pos, has_gauss, cached),
        "torch": torch.get_rng_state().tolist(),
        "tracker": {name: state.tolist() for name, state in
                    tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


# --- 2. RNG states per rank ---------------------------------------------------------------------

RNG_WARNING = "RNG states are per rank and are not restored"


def _rng_cases(rank, world, root):
    build = _build(world, "--ulysses-sp-size", "2")
    _scramble(100 + rank)
    saved = _rng_snapshot()
    _shift_weights(build[1], 0.5)
    weights = _weights(build[1])
    _save(root, build)
    snapshots = [None] * world
    dist.all_gather_object(snapshots, saved)
    for part in ("python", "numpy", "torch", "tracker"):
        assert snapshots[0][part] != snapshots[1][part], part  # the ranks' states differ
    _scramble(7)
    _shift_weights(build[1], 1.0)
    (iteration, consumed), printed = _load(root, build)
    assert (iteration, consumed) == (SAVED_AT, CONSUMED)
    assert _rng_snapshot() == saved  # this rank's own states
    assert "WARNING" not in printed
    _assert_weights(build[1], weights)
    _teardown()

    # Another layout (SP 2 x DP 1 -> SP 1 x DP 2): weights load, RNG stays as seeded.
    build = _build(world)
    seeded = _rng_snapshot()
    (iteration, _), printed = _load(root, build)
    assert iteration == SAVED_AT
    assert _rng_snapshot() == seeded
    _assert_weights(build[1], weights)
    if rank == 0:
        assert printed.count(RNG_WARNING) == 1, printed
        assert "Ulysses SP 2" in printed and "Ulysses SP 1" in printed, printed
        assert "--seed 1234" in printed, printed
    else:
        assert "WARNING" not in printed, printed
    _teardown()

    # Another TP size (TP 1 -> TP 2, the same padded vocab): each rank gets its TP block of
    # every weight (megatron-core's interleaved q, k, v groups included), RNG stays as seeded.
    build = _build(world, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by",
                   "64")
    seeded = _rng_snapshot()
    (iteration, _), printed = _load(root, build)
    assert iteration == SAVED_AT and _rng_snapshot() == seeded
    for name, shard in _weights(build[1]).items():
        whole = weights[name]
        split = [d for d in range(whole.dim()) if whole.shape[d] != shard.shape[d]]
        assert torch.equal(shard, whole.chunk(world, split[0])[rank] if split else whole), name
    assert (printed.count(RNG_WARNING), "TP 1 x" in printed, "TP 2 x" in printed) == (
        (1, True, True) if rank == 0 else (0, False, False)), printed
    _teardown()


def test_every_rank_restores_its_own_rng_and_another_layout_keeps_the_seeded_ones(tmp_path):
    spawn(_rng_cases, 2, str(tmp_path / "ckpt"))


# --- 1. security --------------------------------------------------------------------------------

class Payload:
    """Unpickling it runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _save_base(rank, world, root, flags):
    build = _build(world, *flags)
    _save(root, build)
    _teardown()


def _blob(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _read_metadata(ckpt):
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        return pickle.load(f)  # our own, trusted file


def _write_metadata(ckpt, metadata):
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def _plant_bytes_item(ckpt, key, payload: bytes):
    """Point the BytesIO item `key` (added if absent) at `payload` appended to a shard file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = _read_metadata(ckpt)
    shard = sorted(name for name in os.listdir(ckpt) if name.endswith(".distcp"))[0]
    offset = os.path.getsize(os.path.join(ckpt, shard))
    with open(os.path.join(ckpt, shard), "ab") as f:
        f.write(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(shard, offset, len(payload))
    _write_metadata(ckpt, metadata)
    return os.path.join(ckpt, shard)


def _plant(kind: str, ckpt: str, marker) -> str:
    """Make `ckpt` malicious; returns the file the loader must name."""
    if kind == "common.pt":  # 0.16's common state; 0.19 still loads a legacy common.pt
        path = os.path.join(ckpt, "common.pt")
        with open(path, "wb") as f:
            f.write(_blob({"iteration": SAVED_AT, "evil": Payload(marker)}))
        return path
    if kind == ".metadata":
        metadata = _read_metadata(ckpt)
        metadata.planner_data = Payload(marker)
        _write_metadata(ckpt, metadata)
        return os.path.join(ckpt, ".metadata")
    if kind == "rng ShardedObject":  # where the RNG state used to be pickled, at PP 1 x TP 1
        return _plant_bytes_item(ckpt, "rng_state/shard_0.0_1.1", _blob([Payload(marker)]))
    assert kind == "layer _extra_state"  # Transformer Engine unpickles these bytes
    metadata = _read_metadata(ckpt)
    key = next(k for k in metadata.state_dict_metadata if "._extra_state/" in k)
    evil = torch.frombuffer(bytearray(pickle.dumps(Payload(marker))), dtype=torch.uint8)
    _plant_bytes_item(ckpt, key, _blob([evil]))
    return ckpt


ATTACKS = ("common.pt", ".metadata", "rng ShardedObject", "layer _extra_state")


def _forge_record(ckpt: str) -> None:
    """What an attacker who rewrites files does to the integrity record too (a checksum, not a
    signature): every file's size and CRC-32 as they are now."""
    from megatron_ulysses.training.checkpoint import save_guard

    files = {name: save_guard._describe(os.path.join(ckpt, name))
             for name in save_guard._files(ckpt)}
    with open(os.path.join(ckpt, save_guard.RECORD), "w") as f:
        json.dump({"format": save_guard.RECORD_FORMAT, "algorithm": "crc32", "files": files}, f)


def _attack_each(rank, world, tmp, report):
    """Save one checkpoint, make a malicious copy of it per attack and load each; writes
    {attack: [marker, offending file, loader message]} to `report`."""
    from megatron_ulysses.training.arguments import ConfigError

    base = os.path.join(tmp, "base")
    _save_base(rank, world, base, [])
    found = {}
    for number, kind in enumerate(ATTACKS):
        root = os.path.join(tmp, f"attack{number}")
        shutil.copytree(base, root)
        marker = os.path.join(tmp, f"marker{number}")
        offending = _plant(kind, os.path.join(root, "iter_0000003"), marker)
        _forge_record(os.path.join(root, "iter_0000003"))
        build = _build(world)
        try:
            _load(root, build)
            message = None
        except BaseException as error:  # DCP raises CheckpointException(BaseException)
            message = str(error) if isinstance(error, ConfigError) else repr(error)
        _teardown()
        found[kind] = [marker, offending, message]
    with open(report, "w") as f:
        json.dump(found, f)


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    """{attack: (marker, offending file, loader message)} from one worker."""
    tmp = tmp_path_factory.mktemp("attacks")
    spawn(_attack_each, 1, str(tmp), str(tmp / "report.json"))
    found = json.loads((tmp / "report.json").read_text())
    return {kind: (Path(marker), offending, message)
            for kind, (marker, offending, message) in found.items()}


@pytest.mark.parametrize("kind", ATTACKS)
def test_a_malicious_checkpoint_is_refused_and_its_payload_never_runs(attacked, kind):
    marker, offending, message = attacked[kind]
    assert not marker.exists(), "the checkpoint's payload ran"
    assert message is not None, "the malicious checkpoint loaded"
    assert message.startswith("--load ")
    assert f"refusing to load {offending}" in message
    assert "it holds a pickled posix.system" in message
    assert "could run code" in message


# --- 4. --load validation -----------------------------------------------------------------------

def _tracker(root, text):
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(text)


# name: (base checkpoint flags, load flags, tracker text or None, expected message parts)
VALIDATION = {
    "garbage tracker": ([], [], "iter_12\n", ["--load {root}: {root}/latest_checkpointed_"
                                              "iteration.txt holds b'iter_12\\n'",
                                              "not an iteration number"]),
    "tracker to a missing directory": ([], [], "7", [
        "--load {root}: latest_checkpointed_iteration.txt names iteration 7, but "
        "{root}/iter_0000007 does not exist"]),
    "hidden size": ([], ["--hidden-size", "64"], None, [
        "--load {root}/iter_0000003 was saved with another model",
        "--hidden-size: checkpoint 32, this run 64", "--ffn-hidden-size: checkpoint 128"]),
    "qk layernorm": ([], ["--qk-layernorm"], None, [
        "--qk-layernorm: checkpoint False, this run True"]),
    "learned positions": ([], ["--max-position-embeddings", "32"], None, [
        "--max-position-embeddings: checkpoint 16, this run 32"]),
    "position type": ([], ROPE, None, [
        "--position-embedding-type: checkpoint 'learned_absolute', this run 'rope'"]),
    "rotary percent": (ROPE, ROPE + ["--rotary-percent", "0.5"], None, [
        "--rotary-percent: checkpoint 1.0, this run 0.5"]),
    "layer kind": ([], ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                        "--untie-embeddings-and-output-weights", "--num-layers", "2"], None, [
        "--swiglu: checkpoint False, this run True",
        "--normalization: checkpoint 'LayerNorm', this run 'RMSNorm'",
        "--disable-bias-linear: checkpoint False", "--untie-embeddings-and-output-weights: "
        "checkpoint False", "--num-layers: checkpoint 1, this run 2"]),
    "vocabulary": ([], ["--vocab-size", "200"], None, [
        "padded vocab size (from the tokenizer or --vocab-size, --make-vocab-size-divisible-by "
        "and TP, or --padded-vocab-size): checkpoint 128, this run 256. Run with the "
        "checkpoint's values"]),
    "train iters": ([], ["--train-iters", "2"], None, [
        "--train-iters (2) is smaller than the iteration of the checkpoint at --load "
        "{root}/iter_0000003 (3)"]),
    "same model loads": ([], [], None, []),
    "same rope model loads": (ROPE, ROPE + ["--rotary-base", "500000"], None, [
        "WARNING: --rotary-base 500000 differs from the checkpoint's 10000"]),
    "same rope model loads with yarn": (ROPE, ["--position-embedding-type", "yarn",
                                               "--rotary-scaling-factor", "4"], None, [
        "WARNING: --position-embedding-type yarn: the checkpoint's is rope"]),
}


def _validation_cases(rank, world, tmp, report):
    """Save a checkpoint with learned and one with rotary positions, copy the right one per
    VALIDATION case (its tracker rewritten where the case says) and load each with its flags;
    writes {case: [root, outcome]} to `report`."""
    from megatron_ulysses.training.arguments import ConfigError

    bases = {False: os.path.join(tmp, "learned"), True: os.path.join(tmp, "rope")}
    for rope, base in bases.items():
        _save_base(rank, world, base, ROPE if rope else [])
    outcomes = {}
    for number, (name, (base_flags, flags, tracker, _)) in enumerate(VALIDATION.items()):
        root = os.path.join(tmp, f"case{number}")
        shutil.copytree(bases[bool(base_flags)], root)
        if tracker is not None:
            _tracker(root, tracker)
        build = _build(world, *flags)
        try:
            result, printed = _load(root, build)
            outcome = {"result": list(result), "printed": printed}
        except BaseException as error:  # DCP raises CheckpointException(BaseException)
            outcome = {"error": str(error) if isinstance(error, ConfigError) else repr(error)}
        _teardown()
        outcomes[name] = [root, outcome]
    with open(report, "w") as f:
        json.dump(outcomes, f)


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    """{case: (checkpoint root, outcome of its load)} from one worker."""
    tmp = tmp_path_factory.mktemp("validation")
    spawn(_validation_cases, 1, str(tmp), str(tmp / "report.json"))
    return {name: tuple(found)
            for name, found in json.loads((tmp / "report.json").read_text()).items()}


@pytest.mark.parametrize("name", VALIDATION)
def test_load_validation_gives_one_clear_message(validated, name):
    root, outcome = validated[name]
    parts = [part.format(root=root) for part in VALIDATION[name][3]]
    if name.startswith("same"):
        assert outcome.get("result") == [SAVED_AT, CONSUMED], outcome
        for part in parts:
            assert part in outcome["printed"]
        return
    assert "error" in outcome, f"loaded: {outcome}"
    for part in parts:
        assert part in outcome["error"]


def _args_at(tp: int, padded: int, *flags: str) -> dict:
    """`args_of` BASE at TP `tp` (world `tp`) with `padded` vocab rows."""
    from megatron_ulysses.training.arguments import parse_args
    from megatron_ulysses.training.checkpoint.state import args_of

    config = parse_args(BASE + ["--tensor-model-parallel-size", str(tp), *flags], world_size=tp)
    return args_of(config.with_padded_vocab_size(padded))


def test_another_tp_loads_but_its_padded_vocab_must_be_the_checkpoints():
    """`check_args`: TP is saved, not checked; the vocab rows it pads to are, with the flag
    that keeps the checkpoint's (or why none can at this TP)."""
    from megatron_ulysses.training.checkpoint.load import check_args

    saved = _args_at(2, 256)  # 65 ids padded to a multiple of 128 x 2
    check_args("ckpt", saved, _args_at(1, 256, "--padded-vocab-size", "256"))
    with pytest.raises(ConfigError) as error:
        check_args("ckpt", saved, _args_at(1, 128))
    assert str(error.value) == (
        "--load ckpt was saved with another model: padded vocab size (from the tokenizer or "
        "--vocab-size, --make-vocab-size-divisible-by and TP, or --padded-vocab-size): "
        "checkpoint 256, this run 128. Run with the checkpoint's values (the padding depends "
        "on TP: give --padded-vocab-size 256 to keep the checkpoint's rows)")
    with pytest.raises(ConfigError, match=r"its 102 vocab rows do not split over "
                       r"--tensor-model-parallel-size 4; run at a TP that divides them\)$"):
        check_args("ckpt", _args_at(1, 102), _args_at(4, 512))


# --- 3. durability ------------------------------------------------------------------------------

class Killed(Exception):
    pass


def _fsync_order_case(rank, world, root):
    """Every file and directory of the new checkpoint is fsynced before it is renamed in, the
    root after the rename and after the tracker update; a re-save renames the old one aside
    only after that, and deletes it only after the tracker update."""
    events = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def logged_replace(src, dst, **kwargs):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        return replace(src, dst, **kwargs)

    build = _build(world)
    final = os.path.join(root, "iter_0000003")
    old = final + ".old"
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    with mock.patch.object(os, "fsync", logged_fsync), \
            mock.patch.object(os, "replace", logged_replace):
        for resave in (False, True):
            events.clear()
            _save(root, build)
            synced = [event[1] for event in events if event[0] == "fsync"]
            move_in, staging = next((i, e[1]) for i, e in enumerate(events)
                                    if e[0] == "replace" and e[2] == final)
            assert staging.startswith(final + ".tmp.")  # job-unique
            synced_before = {event[1] for event in events[:move_in] if event[0] == "fsync"}
            for directory, _, files in os.walk(final):
                staged = staging + directory[len(final):]
                assert staged in synced_before, staged
                for name in files:
                    assert os.path.join(staged, name) in synced_before, name
            tracker_in = events.index(("replace", tracker + ".tmp", tracker))
            assert ("fsync", tracker + ".tmp") in events[move_in:tracker_in]
            assert ("fsync", root) in events[move_in:tracker_in]
            assert ("fsync", root) in events[tracker_in:]
            if resave:
                aside = events.index(("replace", final, old))
                last_sync = max(i for i, event in enumerate(events[:move_in])
                                if event[0] == "fsync")
                assert last_sync < aside < move_in
            assert synced
            assert sorted(os.listdir(root)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    _teardown()


def test_files_and_directories_are_fsynced_before_the_renames(tmp_path):
    spawn(_fsync_order_case, 1, str(tmp_path / "ckpt"))


def _killed_resave(rank, world, root, weights_file):
    """Save iteration 3, then re-save it and die between renaming the old directory aside and
    the new one in."""
    build = _build(world)
    _shift_weights(build[1], 0.5)
    _save(root, build)
    torch.save(_weights(build[1]), weights_file)
    _shift_weights(build[1], 1.0)
    staging = os.path.join(root, "iter_0000003.tmp.")
    replace = os.replace

    def dying_replace(src, dst, **kwargs):
        if os.fspath(src).startswith(staging):
            raise Killed("killed between the renames")
        return replace(src, dst, **kwargs)

    with mock.patch.object(os, "replace", dying_replace):
        _save(root, build)


def _recover(rank, world, root, weights_file):
    from megatron_ulysses.training.checkpoint.save_guard import lock_save_dir

    lock_save_dir(root)  # as pretrain() does: the lock holder removes crashed saves' debris
    build = _build(world)
    (iteration, consumed), printed = _load(root, build)
    assert (iteration, consumed) == (SAVED_AT, CONSUMED)
    assert "iter_0000003.old" in printed
    saved = torch.load(weights_file, weights_only=True)
    _assert_weights(build[1], saved)
    _shift_weights(build[1], 2.0)
    newer = _weights(build[1])
    _save(root, build)  # the same iteration again: cleans up the debris
    assert sorted(os.listdir(root)) == [".lock", "iter_0000003",
                                        "latest_checkpointed_iteration.txt"]
    _shift_weights(build[1], 1.0)
    _load(root, build)
    _assert_weights(build[1], newer)
    _teardown()


def test_a_writer_killed_between_the_renames_leaves_a_loadable_checkpoint(tmp_path):
    root, weights = tmp_path / "ckpt", str(tmp_path / "weights.pt")
    with pytest.raises(mp.ProcessRaisedException, match="killed between the renames"):
        spawn(_killed_resave, 1, str(root), weights)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not (root / "iter_0000003").exists()
    assert (root / "iter_0000003.old" / ".metadata").is_file()  # the complete old checkpoint
    spawn(_recover, 1, str(root), weights)


# --- through pretrain_gpt.py --------------------------------------------------------------------

def _pretrain(*flags: str):
    """`python pretrain_gpt.py` (one process, no torchrun: its exit status and stderr as is)."""
    from conftest import REPO_ROOT
    from test_cli import MODEL, RUN

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *MODEL, *RUN, "--mock-data",
               "--vocab-size", "256", "--eval-iters", "0", "--lr-decay-iters", "8", *flags]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _error(result) -> str:
    """The one error line of a failed run, which has no traceback."""
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_cli_reports_load_errors_as_one_message(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = _pretrain("--train-iters", "2", "--save", str(ckpt))
    assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-3000:]

    fewer = _pretrain("--train-iters", "1", "--load", str(ckpt))
    assert fewer.returncode == 2, fewer.stdout[-3000:] + fewer.stderr[-3000:]
    assert _error(fewer) == (
        "pretrain_gpt.py: error: --train-iters (1) is smaller than the iteration of the "
        f"checkpoint at --load {ckpt}/iter_0000002 (2); give --train-iters 2 or more "
        "(--train-samples 8 or more) or --finetune")

    marker = tmp_path / "marker"
    evil = tmp_path / "evil"
    shutil.copytree(ckpt, evil)
    offending = _plant(".metadata", str(evil / "iter_0000002"), marker)
    result = _pretrain("--train-iters", "4", "--load", str(evil))
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert _error(result).startswith(
        f"pretrain_gpt.py: error: --load {evil}/iter_0000002: refusing to load {offending}: it "
        "holds a pickled posix.system")
    assert not marker.exists()

    # a HuggingFace model directory as --load: the conversion named, not a run from scratch
    hf = tmp_path / "Llama-3.1-8B"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (hf / "model-00001-of-00004.safetensors").write_bytes(b"")
    for extra in ([], ["--use-checkpoint-args"]):
        result = _pretrain("--train-iters", "4", "--load", str(hf), *extra)
        assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
        assert _error(result) == (
            f"pretrain_gpt.py: error: --load {hf} is a HuggingFace model directory (config.json "
            "and its weights), not a checkpoint: convert it with `python tools/convert_hf.py "
            f"import --hf-path {hf} --output CKPT`, then give --load CKPT (--use-checkpoint-args "
            "takes its model flags)"), extra


def _extra_state(state) -> dict:
    """A layer's `_extra_state` as Transformer Engine writes it: pickle.dumps of its FP8 state."""
    return {"layer._extra_state": torch.frombuffer(bytearray(pickle.dumps(state)),
                                                   dtype=torch.uint8)}


def test_te_fp8_extra_state_is_admitted_and_a_payload_in_its_tensors_is_not(tmp_path):
    """TE's FP8 extra state holds CPU tensors (pickled through torch.storage._load_from_bytes,
    whose bytes torch.load reads with its full unpickler) and its recipe: the tensors pass, and
    a payload hidden in those storage bytes is refused, never run."""
    from megatron_ulysses.training.checkpoint.trust import check_extra_states

    fp8_state = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3),
                 "extra_fp8_variables": {"num_gemms": 3, "fp8_checkpoint": True}}
    check_extra_states("ckpt", _extra_state(fp8_state))
    # megatron-core 0.19 pickles its storages through its own safe_load_from_bytes (the name
    # an H100 run's FP8 checkpoint held)
    as_019 = pickle.dumps(fp8_state, protocol=3).replace(  # 3: GLOBAL opcodes, no frames
        b"ctorch.storage\n_load_from_bytes\n",
        b"cmegatron.core.safe_globals\nsafe_load_from_bytes\n")
    assert b"safe_load_from_bytes" in as_019
    check_extra_states("ckpt", {"layer._extra_state": torch.frombuffer(bytearray(as_019),
                                                                       dtype=torch.uint8)})

    marker = tmp_path / "ran"
    for legacy in (False, True):  # the storage's own format, and the zip format
        inner = io.BytesIO()
        torch.save({"evil": Payload(marker)}, inner, _use_new_zipfile_serialization=not legacy)
        smuggled = _extra_state({"scale_fwd": _FromBytes(inner.getvalue())})
        with pytest.raises(ConfigError, match="_extra_state"):
            check_extra_states("ckpt", smuggled)
    assert not marker.exists()


class _FromBytes:
    """Pickles as `torch.storage._load_from_bytes(data)`, as a CPU storage does."""

    def __init__(self, data):
        self.data = data

    def __reduce__(self):
        return torch.storage._load_from_bytes, (self.data,)


class _CallsAdamW:
    """Pickles as a call of torch.optim.AdamW (its constructor would run on load)."""

    def __reduce__(self):
        return torch.optim.AdamW, ([torch.zeros(1)],)


def test_the_offloaded_optimizers_classes_pass_as_values_and_are_never_called():
    """--optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer keeps its sub-optimizers'
    classes in its param groups, so its common state names them; a payload calling one is
    refused."""
    from megatron_ulysses.training.checkpoint import trust

    groups = [{"lr": 1e-3, "cpu_optimizer_cls": torch.optim.AdamW,
               "gpu_optimizer_cls": torch.optim.SGD, "params": [0, 1]}]
    trust._check_torch_payload(_blob({"optimizer": {"param_groups": groups}}))
    with pytest.raises(trust._Refused, match="a call of torch.optim.adamw.AdamW"):
        trust._check_torch_payload(_blob({"evil": _CallsAdamW()}))


class _RecordsTheOptIn(torch.nn.Module):
    """Reads Transformer Engine's unsafe-pickle opt-in when its extra state is set, as TE 2.20's
    `set_extra_state` does before it unpickles FP8 delayed scaling's metadata."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.seen = None

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.seen = os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")


def test_checked_extra_states_are_loaded_under_te_opt_in_for_that_load_only(monkeypatch):
    # TE >= 2.20 refuses to unpickle FP8 delayed scaling's extra state without the opt-in (an
    # H100 FP8 resume failed so); the checked load sets it, and the environment is restored.
    from types import SimpleNamespace

    from megatron_ulysses.training.checkpoint.load import _load_weights

    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    layer = _RecordsTheOptIn()
    weights = {"weight": torch.ones(2), **_extra_state({"scale_fwd": torch.ones(3)})}
    weights["_extra_state"] = weights.pop("layer._extra_state")
    _load_weights("ckpt", SimpleNamespace(module=layer), weights)
    assert layer.seen == "1" and torch.equal(layer.weight.detach(), torch.ones(2))
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE" not in os.environ
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "0")  # a user's own setting
    _load_weights("ckpt", SimpleNamespace(module=layer), weights)
    assert os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] == "0"
    # a payload in the extra state is refused before the opt-in is ever set
    weights["_extra_state"] = _extra_state({"scale_fwd": _FromBytes(b"x")})["layer._extra_state"]
    layer.seen = None
    with pytest.raises(ConfigError, match="_extra_state"):
        _load_weights("ckpt", SimpleNamespace(module=layer), weights)
    assert layer.seen is None
