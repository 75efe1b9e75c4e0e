"""Test-only: pretrain_gpt.py's ranks started as torchrun starts them, but forked from one server
process that imported torch and megatron-core once. A fresh interpreter spends ~6 CPU-seconds on
those imports, most of a small run's time: on CI's two cores they were most of the suite's.

`pretrain(nproc, argv)` returns what `subprocess.run([torchrun --nproc-per-node nproc
pretrain_gpt.py *argv], capture_output=True, text=True)` returns. Per launch the server forks an
agent (torchrun's part), which forks the ranks: each in its own session, with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR / MASTER_PORT,
TORCHELASTIC_RUN_ID; OMP_NUM_THREADS 1 unless set), all writing to the caller's stdout and stderr
pipes. When a rank fails the others get SIGTERM, then SIGKILL after torchrun's default
--shutdown-timeout; the status is 1 then (torchrun's), else 0. A rank runs
`pretrain_gpt.main(argv)` and its atexit handlers, as a process that exits does. The server imports with the suite's environment: what a test changes in the
environment reaches the ranks, but not the server's imports. The tests of torchrun's own
behaviour (its signals, its death: tests/integration/test_faults.py) start the real one.
"""

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from distributed import free_port

from megatron_ulysses.training.processes import TORCHRUN_SHUTDOWN_TIMEOUT_S

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "pretrain_gpt.py"
_server = {}


def pretrain(nproc: int, argv, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`pretrain_gpt.py *argv` on `nproc` ranks (the module docstring says how)."""
    args = [str(SCRIPT), *map(str, argv)]
    conn, pipes = _connect(), [os.pipe(), os.pipe()]
    request = {"nproc": nproc, "argv": args[1:], "cwd": os.getcwd(),
               "env": dict(os.environ if env is None else env)}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [w for _, w in pipes])
    outputs = [[] for _ in pipes]
    readers = [threading.Thread(target=_drain, args=(r, out)) for (r, _), out in zip(pipes,
                                                                                    outputs)]
    for (_, w), reader in zip(pipes, readers):
        os.close(w)
        reader.start()
    deadline = time.monotonic() + timeout
    for reader in readers:
        reader.join(max(deadline - time.monotonic(), 0))
    timed_out = any(reader.is_alive() for reader in readers)
    if timed_out:
        conn.shutdown(socket.SHUT_RDWR)  # the agent kills its ranks
    for reader in readers:
        reader.join()
    status = conn.makefile().readline().strip()
    conn.close()
    text = [b"".join(out).decode(errors="replace") for out in outputs]
    if timed_out:
        raise subprocess.TimeoutExpired(args, timeout, *text)
    return subprocess.CompletedProcess(args, int(status or 1), *text)


def _drain(fd: int, into: list) -> None:
    with os.fdopen(fd, "rb") as stream:
        into.append(stream.read())


def _connect() -> socket.socket:
    """A connection to this pytest process's server, started on first use."""
    if "path" not in _server:
        path = os.path.join(tempfile.mkdtemp(prefix="launcher"), "socket")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        process = subprocess.Popen([sys.executable, __file__, path], env=env,
                                   stdin=subprocess.DEVNULL)
        while not os.path.exists(path):
            if process.poll() is not None:
                raise RuntimeError(f"the launcher's server exited with {process.returncode}")
            time.sleep(0.05)
        _server.update(path=path, process=process)
        atexit.register(process.kill)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(_server["path"])
    return conn


# --- the server, the agent and the ranks (forked) ---------------------------------------------

def _serve(path: str) -> None:
    """Import what every rank imports, then fork an agent per request, until the pytest process
    that started it is gone."""
    sys.path.insert(0, str(REPO_ROOT))
    import pretrain_gpt  # noqa: F401  (and through it megatron_ulysses' parser)
    import megatron_ulysses.training.loop  # noqa: F401  (torch, megatron-core)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen()
    listener.settimeout(2.0)
    os.rename(path + ".tmp", path)
    parent = os.getppid()
    while os.getppid() == parent:  # ends with the pytest process, however it ends
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        conn.setblocking(True)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        while not message.endswith(b"\n"):
            message += conn.recv(1 << 20)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            os._exit(_agent(conn, json.loads(message), fds))
        conn.close()
        for fd in fds:
            os.close(fd)
        while _reap_any():
            pass


def _reap_any() -> bool:
    try:
        return os.waitpid(-1, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return False


def _agent(conn: socket.socket, request: dict, fds) -> int:
    """torchrun's part: start the ranks, stop them all when one fails or the caller is gone,
    answer with the status."""
    port = free_port()
    ranks = set()
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _rank(request, fds, rank, port)
        ranks.add(pid)
    for fd in fds:
        os.close(fd)
    status = _wait(ranks, conn)
    try:
        conn.sendall(f"{status}\n".encode())
    except OSError:
        pass
    return 0


def _wait(ranks: set, conn: socket.socket) -> int:
    """0 when every rank exits with 0; else 1, the others stopped as torchrun stops them."""
    conn.setblocking(False)
    failed, stop_at = False, None
    while ranks:
        pid, code = os.waitpid(-1, os.WNOHANG)
        if pid:
            ranks.discard(pid)
            failed = failed or code != 0
        else:
            time.sleep(0.05)
        gone = _caller_gone(conn)
        if (failed or gone) and stop_at is None and ranks:
            stop_at = time.monotonic() + (0 if gone else TORCHRUN_SHUTDOWN_TIMEOUT_S)
            _signal(ranks, signal.SIGTERM)
        if stop_at is not None and time.monotonic() > stop_at:
            _signal(ranks, signal.SIGKILL)
    return int(failed)


def _caller_gone(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _signal(ranks: set, signum: int) -> None:
    for pid in ranks:
        try:
            os.killpg(pid, signum)  # the rank leads its session
        except ProcessLookupError:
            pass


def _rank(request: dict, fds, rank: int, port: int) -> None:
    """One rank: its session, pipes, environment and argv, then pretrain_gpt.main."""
    os.setsid()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    nproc = request["nproc"]
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_RUN_ID=f"launcher-{os.getppid()}")
    os.chdir(request["cwd"])
    sys.argv = [str(SCRIPT), *request["argv"]]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 1
    try:
        import pretrain_gpt
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        code = pretrain_gpt.main(request["argv"])
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else (error.code is not None)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


if __name__ == "__main__":
    _serve(sys.argv[1])
