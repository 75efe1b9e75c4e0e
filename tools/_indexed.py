"""Shared by the dataset tools: input errors reported as one line with exit status 2, outputs
written under temporary names, the check of ``.idx``/``.bin`` files made before megatron-core
mmaps them (``check_index`` of megatron_ulysses.data.datasets, which pretrain_gpt.py runs on
``--data-path``), and the tokenizer sidecar ``<prefix>.tokenizer.json`` that preprocess_data.py
writes and merge_datasets.py compares (megatron_ulysses.data.sidecar)."""

import functools
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Tuple

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:  # megatron_ulysses, for a tool run as tools/<name>.py
    sys.path.insert(0, _REPO_ROOT)

from megatron_ulysses.data import sidecar  # noqa: E402


class ToolError(Exception):
    """A problem with the user's input or files: one ``error:`` line on stderr, exit status 2."""


def reports_errors(main: Callable[..., int]) -> Callable[..., int]:
    """Turn a ``ToolError`` raised by a tool's ``main`` into its one-line message and status 2."""

    @functools.wraps(main)
    def wrapper(argv=None) -> int:
        try:
            return main(argv)
        except ToolError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    return wrapper


_TERMINATED = []  # the signal that asked the main process to stop, once one has
_AT_FORK = []  # the fork hook, once registered


def _terminate(signum, frame):
    _TERMINATED.append(signum)
    raise SystemExit(128 + signum)


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def exit_on_sigterm() -> None:
    """Make SIGTERM (scancel, a SLURM time limit) unwind the calling process like Ctrl-C, so that
    temporary files are removed, with exit status 143. Forked pool workers get the default
    SIGTERM back as they are forked: a Python handler runs only between bytecodes, so a worker
    blocked in C would outlive `Pool.terminate()` and hang its `join()`."""
    if not _AT_FORK:  # hooks cannot be removed: one per process
        os.register_at_fork(after_in_child=_default_sigterm)
        _AT_FORK.append(_default_sigterm)
    signal.signal(signal.SIGTERM, _terminate)


def exit_if_terminated() -> None:
    """Raise the SIGTERM exit again where its first one was swallowed: Python ignores exceptions
    raised inside some callbacks (logging's fork handler, when the signal lands as a pool
    starts), so the work loops and ``Staged.publish`` ask again."""
    if _TERMINATED:
        raise SystemExit(128 + _TERMINATED[0])


def dataset_files(prefix: str) -> Tuple[str, str, str]:
    """``(bin, idx, tokenizer sidecar)`` paths of a dataset prefix."""
    return prefix + ".bin", prefix + ".idx", sidecar.sidecar_path(prefix)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(path: str) -> None:
    """Remove ``path``'s temporary files (``Staged`` names) left by a run on this host whose
    process is gone (killed by SIGKILL or the OOM killer, so it could not clean up). Another
    host's files are kept: on a shared file system its run may still be writing them."""
    host = socket.gethostname()
    pattern = re.compile(re.escape(os.path.basename(path)) + r"\.tmp(\d+)\." + re.escape(host))
    directory = os.path.dirname(os.path.abspath(path))
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match and not _running(int(match.group(1))):
            os.remove(os.path.join(directory, name))
            print(f"removed {os.path.join(directory, name)}: a temporary file of a run (pid "
                  f"{match.group(1)}) that is no longer running", file=sys.stderr)


class Staged:
    """``with Staged(paths) as staged``: write each path under ``staged.tmp[path]``; ``publish()``
    renames them all into place, and leaving the block removes whatever was not published.
    The temporary names carry the PID and host, so that a later run can remove those of a run
    that was killed (``remove_stale_temporaries``)."""

    def __init__(self, paths: Iterable[str]):
        self.tmp = {path: f"{path}.tmp{os.getpid()}.{socket.gethostname()}" for path in paths}
        for path in self.tmp:
            remove_stale_temporaries(path)

    def __enter__(self) -> "Staged":
        return self

    def publish(self) -> None:
        exit_if_terminated()
        for path, tmp in self.tmp.items():
            os.replace(tmp, path)

    def __exit__(self, *exc_info) -> None:
        for tmp in self.tmp.values():
            if os.path.exists(tmp):
                os.remove(tmp)


class DatasetInfo(NamedTuple):
    dtype: type
    sequences: int
    documents: int
    tokens: int


def check_dataset(prefix: str, flag: str) -> DatasetInfo:
    """``check_index`` of ``prefix.idx``/``prefix.bin`` (see megatron_ulysses.data.datasets),
    its ``DataError`` raised as a ``ToolError`` naming ``flag`` (the option that gave
    ``prefix``)."""
    from megatron_ulysses.data.datasets import DataError, check_index

    try:
        index = check_index(prefix, flag)
    except DataError as err:
        raise ToolError(str(err)) from None
    return DatasetInfo(index.dtype.type, index.sequences, index.documents, index.tokens)


def load_tokenizer(args):
    """The tokenizer of a tool's tokenizer flags (``add_tokenizer_arguments``)."""
    from megatron_ulysses.data.tokenizer_flags import check_tokenizer_flags, tokenizer_files
    from megatron_ulysses.data.tokenizers import build_tokenizer_from

    try:
        check_tokenizer_flags(args)
    except ValueError as err:
        raise ToolError(str(err)) from None
    try:
        return build_tokenizer_from(args)
    except (ValueError, ImportError, OSError, RuntimeError) as err:
        flags = ", ".join(f"{flag} {path!r}" for flag, path in tokenizer_files(args).items())
        raise ToolError(f"cannot build the tokenizer (--tokenizer-type {args.tokenizer_type}"
                        f"{', ' + flags if flags else ''}, --vocab-size {args.vocab_size}): "
                        f"{err}") from None


def read_sidecar(prefix: str, flag: str) -> Optional[Dict]:
    """``read_sidecar`` of megatron_ulysses.data.sidecar, a damaged record a ``ToolError``."""
    try:
        return sidecar.read_sidecar(prefix, flag)
    except ValueError as err:
        raise ToolError(str(err)) from None
