"""The trainer's helper processes: they outlive no rank, and SIGTERM or SIGINT does not kill
them first.

A rank starts helpers it does not control: torch DataLoader workers (forked), megatron-core's
checkpoint writers (forked per save) and the `multiprocessing.Manager` server holding its write
results queue (spawned at the first save, with multiprocessing's resource tracker). Two faults
follow from that:

* Preemption. SLURM, Kubernetes and torchrun (which forwards its SIGTERM with `os.killpg` to
  each worker's process group) signal every process at once. With `--exit-signal-handler` the
  rank only notes the signal and saves at the next iteration boundary, but its helpers died at
  once (a DataLoader worker "killed by signal: Terminated", a BrokenPipeError from the dead
  Manager), taking the save with them. `helpers_keep_signals_blocked` starts helpers with
  SIGTERM blocked: the mask is inherited through fork and exec and nothing in them unblocks it,
  so a SIGTERM meant for the job stays pending in them and the rank saves. SIGINT too (Ctrl-C,
  which torchrun forwards the same way): a helper would print its own KeyboardInterrupt
  traceback; the rank reports the interrupt once and kills its helpers (`cli.stop_children`).
* Orphans. A rank killed with SIGKILL cannot stop its helpers; a spawned Manager server never
  notices, and it, the resource tracker and a writer blocked on a semaphore kept the job's stdout
  open, so `torchrun ... | tee log` never ended. `start_reaper` forks a small process that waits
  for the rank to be gone (PR_SET_PDEATHSIG, checked with getppid) and then SIGKILLs the rank's
  process group, taking every helper with it whatever started it. It does so only where the rank
  leads its own session (torchrun's workers: `start_new_session=True`), so that group holds the
  rank's descendants only, never a shell pipeline's `tee`.

torchrun itself: `die_with_launcher` asks for SIGTERM when torchrun dies (SIGKILLed, say), so a
rank with `--exit-signal-handler` saves and exits instead of training on, orphaned. After
forwarding a SIGTERM torchrun waits `--shutdown-timeout` seconds (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
30 by default) and then SIGKILLs the ranks: the rest of the iteration and the save must fit, which
`save_beyond_grace` warns about when the last save alone did not.
"""

import contextlib
import ctypes
import multiprocessing.resource_tracker
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_WAKE = signal.SIGUSR2  # the reaper's death signal; any other sender is ignored (getppid check)
_REAPER_POLL_S = 5.0  # a second look at getppid, should the death signal be lost
SHUTDOWN_TIMEOUT_ENV = ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT")
TORCHRUN_SHUTDOWN_TIMEOUT_S = 30  # torch.distributed.launcher.api.LaunchConfig's default
_warned_grace = False


def _set_death_signal(signum: int) -> bool:
    """PR_SET_PDEATHSIG: the kernel sends `signum` to this process when its parent dies.
    False where unavailable (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def leads_own_session() -> bool:
    """True for torchrun's workers (each starts a new session, so its process group holds
    its own descendants only)."""
    return os.getsid(0) == os.getpid()


def _reap(rank_pid: int) -> None:
    """The reaper's body (in the forked child; never returns): wait until `rank_pid`, its
    parent, is gone, then SIGKILL the process group (the rank's helpers, and itself)."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # SIGKILL only
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # holds nothing of the job's: no stdout keeping a `| tee` open
            os.dup2(devnull, fd)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        _set_death_signal(_WAKE)
        while os.getppid() == rank_pid:
            signal.sigtimedwait([_WAKE], _REAPER_POLL_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(0)


def start_reaper() -> bool:
    """Fork the reaper where this rank leads its own session (see the module docstring); call
    it before any helper or thread is started. Returns whether one was started."""
    if not leads_own_session() or not sys.platform.startswith("linux"):
        return False
    rank_pid = os.getpid()
    if os.fork() == 0:
        _reap(rank_pid)
    return True


def guard_rank() -> None:
    """At a rank's start, before any helper or thread: its helpers die with it, it with
    torchrun."""
    start_reaper()
    die_with_launcher()


def die_with_launcher() -> None:
    """Under torchrun (a new session per worker): SIGTERM when torchrun dies, as if it had
    forwarded one. Where the launcher died already (before this call) the rank stops now."""
    if not (leads_own_session() and "TORCHELASTIC_RUN_ID" in os.environ):
        return
    launcher = os.getppid()
    if _set_death_signal(signal.SIGTERM) and os.getppid() != launcher:
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def helpers_keep_signals_blocked():
    """Run a block that starts helper processes (a DataLoader's workers, a checkpoint save)
    with SIGTERM and SIGINT blocked in this thread, so that they start, and stay, with them
    blocked. A signal for this process meanwhile waits (or goes to another thread): the rank's
    own handler still sees it, after the block."""
    # The resource tracker unblocks SIGTERM after starting itself: start it first.
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def shutdown_grace_s() -> int:
    """Seconds torchrun waits between its SIGTERM and its SIGKILL."""
    for name in SHUTDOWN_TIMEOUT_ENV:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return TORCHRUN_SHUTDOWN_TIMEOUT_S


def save_beyond_grace(save_s: float):
    """The warning (once per process) when a save took longer than torchrun's grace after
    SIGTERM: a save on SIGTERM would then be killed before it completes (the last checkpoint
    stays, the work since is lost). None otherwise."""
    global _warned_grace
    grace = shutdown_grace_s()
    if _warned_grace or save_s < grace:
        return None
    _warned_grace = True
    return (f"--exit-signal-handler: this save took {save_s:.0f} s, but torchrun kills the "
            f"ranks {grace} s after forwarding a SIGTERM (and a scheduler's grace may be "
            "shorter): a save on SIGTERM would not complete. Give torchrun --shutdown-timeout "
            "above the save time plus one iteration, and the scheduler as long a grace (SLURM: "
            "KillWait, or --signal=TERM@<seconds> before the time limit; Kubernetes: "
            "terminationGracePeriodSeconds)")
