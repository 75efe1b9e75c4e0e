"""Guards around checkpoint files: one live job per --save, saves that cannot mix two jobs'
files, an integrity record checked before a checkpoint is trained on, and one message for a save
that fails on I/O.

* Lock. Rank 0 holds a POSIX record lock (`fcntl.lockf`) on `<save>/.lock` for the whole run; a
  second job's rank 0 finds it held and stops with one message naming the holder. The kernel
  drops the lock when its process dies, so a dead job never holds it (record locks, unlike
  `flock`, are not inherited by forked helpers, and network file systems implement them). On a
  file system without locks the run warns and goes on.
* Staging. Each save is written to `iter_N.tmp.<pid>-<random>`, made by rank 0 and broadcast, so
  two jobs (or a crashed one's debris) never share a staging directory. The lock holder removes
  the debris of crashed saves (`iter_N.tmp*`).
* Integrity record. Before the rename every rank records the size and CRC-32 of the files it
  wrote (`__<rank>_*.distcp`; rank 0 the others); rank 0 checks that the directory holds exactly
  those files and writes them to `integrity.json`. Before a load: every recorded file is there
  with its size and nothing else is, the small files have their CRC-32 (`verify_files`, no
  process group needed), and the ranks split the shard files' CRC-32 between them
  (`verify_shards`). CRC-32 (zlib) runs at about 2 GB/s on one core, so a rank checks its share
  in about a second per 2 GB. Checkpoints without a record (older ones) are loaded unchecked.
* I/O errors. An OSError while saving (no space, no permission, a read-only file system) becomes
  one `SaveError` naming --save, the failure, the checkpoint's size and the free space; the
  committed checkpoints are untouched (nothing is renamed before the save is complete).
"""

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import time
import zlib

import torch.distributed as dist

from ...errors import ConfigError
from ..logging import print_rank_0

LOCK = ".lock"
RECORD = "integrity.json"
RECORD_FORMAT = 1
_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
_STAGING = re.compile(r"iter_\d+\.tmp(\..+)?")
_CHUNK = 1 << 24
_held = {}  # real path of a locked --save -> the lock file's descriptor (held until exit)


class SaveError(ConfigError):
    """A save that failed on I/O; the message names --save (only the rank that saw the error
    has the details: the others' message says so)."""


# --- one live job per --save --------------------------------------------------------------------

def _holder() -> str:
    jobs = [f"{name} {os.environ[name]}" for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
            if name in os.environ]
    return (f"pid {os.getpid()} on {socket.gethostname()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}" + "".join(f", {job}" for job in jobs))


def lock_save_dir(root: str) -> None:
    """Rank 0, before the process groups: hold `<root>/.lock` for the rest of this process, or
    raise `ConfigError` naming the live job that holds it."""
    real = os.path.realpath(root)
    if real in _held:
        return
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            print_rank_0(f" WARNING: --save {root}: cannot lock {path} ({error.strerror}): a "
                         "second job saving there is not refused (its saves still never mix "
                         "files with this job's)")
            return
        with open(path, errors="replace") as f:
            holder = f.read(400).strip() or "unknown"
        raise ConfigError(f"--save {root} is in use by another live job ({holder}): two jobs "
                          "saving to one directory overwrite each other's checkpoints. Give "
                          "this job another --save, or stop the other job first") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (_holder() + "\n").encode(), 0)
    _held[real] = fd


def _holds_lock(root: str) -> bool:
    return os.path.realpath(root) in _held


# --- staging ------------------------------------------------------------------------------------

def _make_staging(final: str) -> str:
    """Rank 0: a new, job-unique staging directory for `final` (after removing crashed saves'
    debris, when this process holds the lock: no live job writes there then)."""
    root = os.path.dirname(final) or "."
    os.makedirs(root, exist_ok=True)
    if _holds_lock(root):
        for name in os.listdir(root):
            if _STAGING.fullmatch(name):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    staging = f"{final}.tmp.{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(staging)
    return staging


class _FailedOnRank0(Exception):
    """A rank-0 step of the save failed; rank 0 raises the error itself."""


def on_rank_0(step, *args):
    """Every rank: `step(*args)` runs on rank 0 and every rank returns its result, or every rank
    raises when it failed with an OSError (rank 0 that error), so no rank is left waiting in a
    collective for a rank 0 that is gone."""
    outcome = [None, False]
    failure = None
    if dist.get_rank() == 0:
        try:
            outcome = [step(*args), False]
        except OSError as error:
            failure, outcome = error, [None, True]
    dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[1]:
        raise _FailedOnRank0()
    return outcome[0]


def staging_dir(final: str) -> str:
    """Every rank: the staging directory of this save (rank 0 makes it)."""
    return on_rank_0(_make_staging, final)


# --- the integrity record -----------------------------------------------------------------------

def owns(name: str, rank: int) -> bool:
    """Which rank wrote (fsyncs, records) a checkpoint file: `__<rank>_*.distcp` its rank,
    everything else rank 0."""
    match = _SHARD.fullmatch(name)
    return int(match.group(1)) == rank if match else rank == 0


def _files(directory: str) -> list:
    """The files under `directory`, relative to it, without the record."""
    found = []
    for path, _, names in os.walk(directory):
        found += [os.path.relpath(os.path.join(path, n), directory) for n in names]
    return sorted(name for name in found if name != RECORD)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _describe(path: str) -> list:
    return [os.path.getsize(path), _crc32(path)]


def seal(staging: str, rank: int) -> None:
    """Every rank: the size and CRC-32 of the files it wrote; rank 0: check that `staging`
    holds exactly the files the ranks wrote, then write and fsync the record."""
    mine = {name: _describe(os.path.join(staging, name)) for name in _files(staging)
            if owns(os.path.basename(name), rank)}
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    on_rank_0(lambda: _write_record(staging, parts))


def _write_record(staging: str, parts) -> None:
    files = {name: entry for part in parts for name, entry in part.items()}
    present = set(_files(staging))
    if present != set(files):
        strays = sorted(present ^ set(files))
        raise OSError(errno.EEXIST, "the staging directory changed during the save: "
                      f"{', '.join(strays[:4])} {'is' if len(strays) == 1 else 'are'} not "
                      "what the ranks wrote", staging)
    record = os.path.join(staging, RECORD)
    with open(record, "w") as f:
        json.dump({"format": RECORD_FORMAT, "algorithm": "crc32", "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(staging, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _damaged(path: str, name: str, what: str) -> ConfigError:
    return ConfigError(f"--load {path}: {name} {what}. The checkpoint is "
                       f"damaged (its save recorded every file's size and CRC-32 in {RECORD}); "
                       "--load a copy or another checkpoint")


def _check_crc(path: str, name: str, entry) -> None:
    crc = _crc32(os.path.join(path, name))
    if crc != entry[1]:
        raise _damaged(path, name, f"does not hold the bytes its save wrote (CRC-32 {crc:08x}, "
                                   f"recorded {entry[1]:08x})")


def _read_record(path: str):
    file = os.path.join(path, RECORD)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, "rb") as f:
            record = json.loads(f.read())
        files = record["files"]
        if record.get("format") != RECORD_FORMAT or not all(
                isinstance(n, str) and isinstance(e, list) and len(e) == 2 and
                all(isinstance(x, int) for x in e) for n, e in files.items()):
            raise ValueError(f"format {record.get('format')!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise _damaged(path, RECORD, f"is not a valid record ({error})") from None
    return files


def verify_files(path: str):
    """Before anything in checkpoint directory `path` is read: each recorded file is there with
    its recorded size, no other file is, and the small files (all but the shards) have their
    CRC-32. Returns the record's files (None for a checkpoint saved without a record)."""
    files = _read_record(path)
    if files is None:
        return None
    present = set(_files(path))
    for name, (size, _) in sorted(files.items()):
        if name not in present:
            raise _damaged(path, name, f"is missing (its save wrote {size} bytes)")
        actual = os.path.getsize(os.path.join(path, name))
        if actual != size:
            raise _damaged(path, name, f"has {actual} bytes, its save wrote {size}")
    strays = sorted(present - set(files))
    if strays:
        raise _damaged(path, strays[0], "was not written by the save of this checkpoint (another "
                       "job's or a copy's file?)")
    for name, entry in sorted(files.items()):
        if not _SHARD.fullmatch(os.path.basename(name)):
            _check_crc(path, name, entry)
    return files


def verify_shards(path: str) -> None:
    """Every rank, after `verify_files`: the CRC-32 of the recorded shard files, split over the
    ranks; every rank raises the same `ConfigError` for the first bad one."""
    files = _read_record(path) or {}
    shards = sorted(name for name in files if _SHARD.fullmatch(os.path.basename(name)))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem = None
    for name in shards[rank::world]:
        try:
            _check_crc(path, name, files[name])
        except ConfigError as error:
            problem = str(error)
            break
    problems = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    found = [p for p in problems if p is not None]
    if found:
        raise ConfigError(found[0])


@contextlib.contextmanager
def read_errors_named(path: str):
    """Around megatron-core's reads of checkpoint `path`: where it has no record (saved before
    records were written), an error reading it is one `ConfigError` naming --load. (With a
    record the files are those its save wrote, so an error there is no damage: it propagates.)"""
    try:
        yield
    except BaseException as error:
        if isinstance(error, ConfigError) or os.path.isfile(os.path.join(path, RECORD)) or not (
                isinstance(error, Exception) or type(error).__name__ == "CheckpointException"):
            raise
        cause = str(error).strip().splitlines()[-1][:300] if str(error).strip() else ""
        raise ConfigError(f"--load {path}: reading the checkpoint failed ({type(error).__name__}:"
                          f" {cause}). It has no {RECORD} (saved before megatron_ulysses "
                          "recorded its files), so the damaged file cannot be named: compare "
                          "its files with a good copy, or --load another checkpoint") from None


# --- I/O errors during a save -------------------------------------------------------------------

def _failure(error: BaseException):
    """What failed in a save, as (text, whether this rank saw it), or None when `error` is no
    save failure: an OSError in the exception chain, or torch.distributed.checkpoint's
    CheckpointException, which megatron-core raises on every rank with the ranks' errors
    (pickled, so their text only) on its coordinator alone."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, _FailedOnRank0):
            return None, False
        if isinstance(error, OSError):
            return str(error), True
        failures = getattr(error, "failures", None)
        if type(error).__name__ == "CheckpointException" and isinstance(failures, dict):
            if not failures:
                return None, False
            return "; ".join(f"{_innermost(failure)} (rank {rank})"
                             for rank, failure in sorted(failures.items())), True
        error = error.__cause__ or error.__context__
    return None


def _innermost(failure) -> str:
    """A CheckpointException failure's text, without megatron-core's writer wrapper."""
    error = failure[0] if isinstance(failure, tuple) else failure
    text = str(error).removeprefix("Worker failure: ")
    return text if text.startswith("[Errno") else f"{type(error).__name__}: {text}"


def _size(num: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if num < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "bytes" else f"{num:.1f} {unit}"
        num /= 1024


@contextlib.contextmanager
def staged_save(root: str, iteration: int, final: str, needed_bytes):
    """Every rank: yields this save's staging directory for `final` (`staging_dir`). An I/O
    error inside, on any rank, becomes one `SaveError` naming --save (`save_error`).
    `needed_bytes()`: about what the save writes."""
    staging = None
    try:
        staging = staging_dir(final)
        yield staging
    except BaseException as error:
        failure = save_error(error, root, iteration, staging, needed_bytes)
        if failure is None:
            raise
        raise failure from None


def save_error(error: BaseException, root: str, iteration: int, staging, needed_bytes):
    """Every rank, after `error` ended the save of `iteration` (in the loop, or in an async
    save's finalize step): the one `SaveError` naming --save, the failure, the bytes needed and
    the free space, or None where `error` is no I/O failure. Rank 0 first removes the staging
    directory, so the free space it reports is what the next save has."""
    found = _failure(error)
    if found is None:
        return None
    if staging is not None and dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    cause, seen_here = found
    if not seen_here:
        return SaveError(f"--save {root}: saving iteration {iteration} failed on another rank "
                         "(rank 0 reports why)")
    needed = needed_bytes()
    try:
        free_bytes = shutil.disk_usage(root).free
    except OSError:
        free_bytes = None
    if free_bytes is not None and free_bytes < needed \
            and not cause.startswith("[Errno 28]"):  # torch's zip writer can hide ENOSPC
        cause = f"No space left on device ({cause})"
    free = "unknown" if free_bytes is None else _size(free_bytes)
    return SaveError(
        f"--save {root}: saving iteration {iteration} failed: {cause}. The checkpoint needs "
        f"about {_size(needed)} ({needed} bytes); {free} free there. "
        "The checkpoints already in --save are untouched (latest_checkpointed_iteration.txt "
        "names the last complete one): free space or fix the permissions, or give another "
        "--save, and resume with --load")
