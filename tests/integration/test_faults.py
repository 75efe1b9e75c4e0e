"""Faults a cluster job meets, each as the cluster delivers it (torchrun, 2 gloo processes, a tiny
GPT on mock data):

- Preemption: SIGTERM to torchrun (which forwards it to each worker's process group), or to
  every process of the job at once (SLURM), at an iteration boundary or in the middle of a save,
  with DataLoader workers: every rank saves at the next iteration boundary and exits, and the
  resumed run equals an uninterrupted one bitwise (losses and every saved tensor).
- A rank SIGKILLed during a save, or torchrun SIGKILLed: `torchrun ... | tee` ends and no
  process of the job survives (DataLoader workers, megatron-core's Manager and writers, the
  resource tracker); with torchrun gone the ranks save first.
- Two jobs with one --save: the second is refused with one message; a dead job holds nothing;
  a save never commits a file it did not write.
- Damaged checkpoints (truncated, emptied or one byte short, a flipped byte, a missing or a
  stray file, a broken record): one message naming --load and the file, before training (the
  record's check, or the trust scan's where it reads a damaged pickled file first).
- Save-time I/O errors (a full file system, --save turned read-only mid-run, in a mount
  namespace of their own): one message naming --save, what failed and the space; the last
  checkpoint stays loadable.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from conftest import REPO_ROOT
from test_cli import ITERATION, MODEL, _checkpoint_tensors

from megatron_ulysses.errors import ConfigError

RUN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
       "--lr-warmup-iters", "2", "--log-interval", "1", "--mock-data", "--vocab-size", "256",
       "--eval-iters", "0", "--ulysses-sp-size", "2"]
TRAIN_ITERS = 16
TRACKER = "latest_checkpointed_iteration.txt"
EXITING = re.compile(r"exiting at iteration (\d+) \(SIGTERM received\)")


def torchrun(*flags: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", str(REPO_ROOT / "pretrain_gpt.py"), *MODEL, *RUN, *flags]


def job_env(tag: str = "") -> dict:
    """The job's environment; every process it starts inherits FAULTS_JOB=tag."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", FAULTS_JOB=tag)


def job_processes(tag: str) -> list:
    """The live processes carrying FAULTS_JOB=tag, whoever their parent is now."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"FAULTS_JOB={tag}".encode() in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/stat") as stat:
                        if stat.read().split(") ")[-1][0] != "Z":
                            found.append(int(pid))
        except OSError:
            pass
    return found


def wait_for(condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def saving(save, after: int = 3):
    """A save of iteration >= `after` is in progress (its staging directory exists)."""
    names = os.listdir(save) if os.path.isdir(save) else []
    return any(re.fullmatch(r"iter_(\d+)\.tmp\..+", n) and int(n[5:12]) >= after
               for n in names)


def ranks_of(launcher: int) -> dict:
    """{rank: pid} of torchrun's workers."""
    ranks = {}
    for pid in subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True,
                              text=True).stdout.split():
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = int(pid)
    return ranks


def losses(text: str) -> dict:
    return {int(i): v for i, v in ITERATION.findall(text)}  # the logged digits, as strings


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: TRAIN_ITERS iterations in one go; (losses, saved tensors)."""
    save = tmp_path_factory.mktemp("uninterrupted")
    result = subprocess.run(torchrun("--train-iters", str(TRAIN_ITERS), "--num-workers", "2",
                                     "--save", str(save)),
                            env=job_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(result.stdout), save / f"iter_{TRAIN_ITERS:07d}"


def _signal(process, save, target: str) -> None:
    if target == "torchrun":
        process.send_signal(signal.SIGTERM)
        return
    everyone = [process.pid]  # as SLURM does: every process of the job step at once
    for pid in ranks_of(process.pid).values():
        everyone += [int(p) for p in subprocess.run(["pgrep", "-s", str(pid)], capture_output=True,
                                                    text=True).stdout.split()]
    for pid in everyone:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:  # ended since pgrep listed it (a save's short-lived writer)
            pass  # a rank that ended early fails the checks after the signal


@pytest.mark.parametrize("target, when", [("torchrun", "iteration"), ("every process", "save")])
def test_sigterm_saves_on_every_rank_and_the_resume_is_bitwise(uninterrupted, tmp_path, target,
                                                              when):
    expected_losses, expected_checkpoint = uninterrupted
    save = str(tmp_path / "save")
    flags = ["--train-iters", str(TRAIN_ITERS), "--num-workers", "2", "--save", save]
    process = subprocess.Popen(torchrun(*flags, "--exit-signal-handler", "--save-interval", "1"),
                               env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    if when == "save":  # in the middle of a save (its staging directory exists)
        wait_for(lambda: saving(save), 120, "a save")
        _signal(process, save, target)
        assert saving(save), "the save was over before the signal"
    else:
        for line in process.stdout:
            found = ITERATION.search(line)
            if found and int(found.group(1)) >= 3:
                _signal(process, save, target)
                break
    output = process.stdout.read() if when == "iteration" else ""
    output += process.communicate(timeout=120)[0]
    stopped = [int(i) for i in EXITING.findall(output)]
    assert len(stopped) == 1 and stopped[0] < TRAIN_ITERS, output[-3000:]
    for fault in ("killed by signal", "BrokenPipeError", "RuntimeError", "pretrain_gpt.py: error"):
        assert fault not in output, output[-3000:]
    with open(os.path.join(save, TRACKER)) as f:
        assert int(f.read()) == stopped[0]

    resumed = subprocess.run(torchrun(*flags, "--load", save), env=job_env(), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = losses(resumed.stdout)
    assert sorted(got) == list(range(stopped[0] + 1, TRAIN_ITERS + 1))
    assert got == {i: expected_losses[i] for i in got}
    final = _checkpoint_tensors(os.path.join(save, f"iter_{TRAIN_ITERS:07d}"))
    reference = _checkpoint_tensors(expected_checkpoint)
    assert final.keys() == reference.keys() and len(final) > 20
    assert [key for key in final if not torch.equal(final[key], reference[key])] == []


@pytest.mark.parametrize("killed", ["rank 1, during a save", "torchrun"])
def test_a_killed_rank_or_torchrun_leaves_no_process_and_the_pipe_ends(tmp_path, killed):
    tag, save, log = uuid.uuid4().hex, str(tmp_path / "save"), tmp_path / "train.log"
    # Without torchrun the ranks save on the SIGTERM they get (--exit-signal-handler); with a
    # rank gone the others cannot, and would only wait for torchrun's SIGKILL.
    handler = ["--exit-signal-handler"] if killed == "torchrun" else []
    command = " ".join(torchrun("--train-iters", "100000", "--num-workers", "2", "--save", save,
                                "--save-interval", "1", *handler))
    pipeline = subprocess.Popen(["bash", "-c", f"{command} 2>&1 | tee {log}"], env=job_env(tag),
                                stdout=subprocess.DEVNULL)
    wait_for(lambda: saving(save), 120, "a save")
    launcher = wait_for(lambda: [int(p) for p in subprocess.run(
        ["pgrep", "-f", "-P", str(pipeline.pid), "torch.distributed.run"], capture_output=True,
        text=True).stdout.split()], 10, "torchrun")[0]
    os.kill(ranks_of(launcher)[1] if killed.startswith("rank") else launcher, signal.SIGKILL)
    pipeline.wait(timeout=90)  # `| tee` reads to EOF: no process holds the job's stdout
    wait_for(lambda: not job_processes(tag), 10, "the job's processes to end")
    if killed == "torchrun":  # the ranks got SIGTERM (PR_SET_PDEATHSIG): they saved
        stopped = EXITING.findall(log.read_text())
        assert len(stopped) == 1, log.read_text()[-3000:]
        with open(os.path.join(save, TRACKER)) as f:
            assert f.read() == stopped[0]
        return
    # A dead job holds no lock: the next one saves there.
    resumed = subprocess.run(torchrun("--train-iters", "100000", "--exit-interval", "1",
                                      "--load", save, "--save", save),
                             env=job_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]


def test_a_second_job_on_the_same_save_is_refused(tmp_path):
    save = str(tmp_path / "save")
    first = subprocess.Popen(torchrun("--train-iters", "100000", "--save", save), env=job_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in first.stdout:
            if ITERATION.search(line):
                break
        second = subprocess.run(
            [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *MODEL, *RUN[:-2],
             "--train-iters", "4", "--save", save], env=job_env(), capture_output=True,
            text=True, timeout=300)
        rank_0 = ranks_of(first.pid)[0]
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    errors = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        f"pretrain_gpt.py: error: --save {save} is in use by another live job (pid {rank_0} on "
        ), second.stderr
    assert not os.path.exists(os.path.join(save, "iter_0000004"))


def _stray_file_case(rank, world, root):
    from megatron_ulysses.training.checkpoint import save_guard

    final = os.path.join(root, "iter_0000001")
    assert save_guard.staging_dir(final) != save_guard.staging_dir(final)  # save-unique
    with pytest.raises(save_guard.SaveError, match=r"__1_0\.distcp is not what the ranks wrote"):
        with save_guard.staged_save(root, 1, final, lambda: 0) as staging:
            for name, data in (("__0_0.distcp", b"ours"), (".metadata", b"ours"),
                               ("__1_0.distcp", b"another job's")):  # no rank 1 here
                with open(os.path.join(staging, name), "wb") as f:
                    f.write(data)
            save_guard.seal(staging, rank)
    assert not os.path.exists(final)


def test_a_save_never_commits_a_file_it_did_not_write(tmp_path):
    from distributed import spawn

    spawn(_stray_file_case, 1, str(tmp_path))


def _truncate(keep):
    return lambda path: os.truncate(path, keep(os.path.getsize(path)))


def _flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


DAMAGE = [  # (file, damage, the message's words)
    ("__1_0.distcp", _truncate(lambda n: n // 2), "bytes, its save wrote"),
    ("__0_1.distcp", _truncate(lambda n: 0), "has 0 bytes, its save wrote"),
    ("__1_1.distcp", _truncate(lambda n: n - 1), "bytes, its save wrote"),
    ("common.pt", os.remove, "is missing (its save wrote"),
    ("__0_0.distcp", _flip, "does not hold the bytes its save wrote"),
    (".metadata", _flip, "does not hold the bytes its save wrote"),
    ("__9_0.distcp", lambda path: open(path, "wb").write(b"x"), "was not written by the save"),
    ("integrity.json", lambda path: open(path, "w").write("{"), "is not a valid record"),
]


@pytest.mark.parametrize("name, damage, words", DAMAGE, ids=[d[0] + str(i)
                                                              for i, d in enumerate(DAMAGE)])
def test_a_damaged_checkpoint_is_one_message_naming_the_file(uninterrupted, tmp_path, name,
                                                             damage, words):
    from megatron_ulysses.training.checkpoint.load import read_common_state
    from megatron_ulysses.training.checkpoint.save_guard import verify_shards

    root = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[1], root / f"iter_{TRAIN_ITERS:07d}")
    (root / TRACKER).write_text(str(TRAIN_ITERS))
    path = str(root / f"iter_{TRAIN_ITERS:07d}")
    damage(os.path.join(path, name))
    with pytest.raises(ConfigError) as error:  # what load_checkpoint runs before any load
        verify_shards(read_common_state(str(root))[1])
    message = str(error.value)
    assert message.startswith(f"--load {path}: ") and name in message
    # the record's check, or the trust scan's (it reads the pickled files first)
    assert words in message or "is not a valid checkpoint file" in message, message


def test_the_cli_refuses_a_flipped_byte_and_names_an_unrecorded_damage(uninterrupted, tmp_path):
    flipped, unrecorded = tmp_path / "flipped", tmp_path / "unrecorded"
    for root in (flipped, unrecorded):
        shutil.copytree(uninterrupted[1], root / f"iter_{TRAIN_ITERS:07d}")
        (root / TRACKER).write_text(str(TRAIN_ITERS))
    _flip(flipped / f"iter_{TRAIN_ITERS:07d}" / "__1_0.distcp")
    os.remove(unrecorded / f"iter_{TRAIN_ITERS:07d}" / "integrity.json")  # an older save's
    _truncate(lambda n: n // 2)(unrecorded / f"iter_{TRAIN_ITERS:07d}" / "__1_0.distcp")
    for root, words in ((flipped, "__1_0.distcp does not hold the bytes its save wrote"),
                        (unrecorded, "reading the checkpoint failed")):
        result = subprocess.run(torchrun("--train-iters", str(TRAIN_ITERS + 4), "--load",
                                         str(root)), env=job_env(), capture_output=True,
                                text=True, timeout=300)
        assert result.returncode != 0
        errors = [line for line in result.stderr.splitlines() if "pretrain_gpt.py: error" in line]
        assert len(errors) == 1, result.stderr[-3000:]
        assert f"--load {root}/iter_{TRAIN_ITERS:07d}: " in errors[0] and words in errors[0]
        assert "Traceback (most recent call last):\n  File \"" + str(REPO_ROOT) \
            not in result.stderr
        assert not ITERATION.search(result.stdout)  # nothing trained on it


# --- save-time I/O errors, in a mount namespace with a small tmpfs as --save --------------------

NAMESPACE = ["unshare", "--user", "--map-root-user", "--mount"]
IO_SCRIPT = """set -u
mount -t tmpfs -o size=$SIZE tmpfs "$MNT"
if [ "$FAULT" = full ]; then
    "$@" > "$LOG" 2>&1; echo "rc=$?" >> "$LOG"
else  # --save turns read-only once the first checkpoint is there
    "$@" > "$LOG" 2>&1 & job=$!
    until [ -f "$MNT/save/latest_checkpointed_iteration.txt" ]; do sleep 0.01; done
    mount --bind "$MNT/save" "$MNT/save" && mount -o remount,bind,ro "$MNT/save"
    wait $job; echo "rc=$?" >> "$LOG"
fi
cp -a "$MNT/save" "$OUT"
"""


def _namespaces_work() -> bool:
    try:
        return subprocess.run([*NAMESPACE, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _namespaces_work(), reason="needs unshare --user --mount (to mount a "
                    "small tmpfs without root)")
@pytest.mark.parametrize("fault, size, words", [
    ("full", "3m", "No space left on device"),
    ("read-only", "50m", "Read-only file system"),
])
def test_a_save_io_error_is_one_message_and_keeps_the_last_checkpoint(tmp_path, fault, size,
                                                                      words):
    from megatron_ulysses.training.checkpoint.load import read_common_state
    from megatron_ulysses.training.checkpoint.save_guard import verify_shards

    mnt, out, log = tmp_path / "mnt", tmp_path / "out", tmp_path / "train.log"
    mnt.mkdir()
    save = f"{mnt}/save"
    env = dict(job_env(), MNT=str(mnt), OUT=str(out), LOG=str(log), SIZE=size,
               FAULT="full" if fault == "full" else "ro")
    subprocess.run([*NAMESPACE, "bash", "-c", IO_SCRIPT, "io",
                    *torchrun("--train-iters", "1000", "--save-interval", "2", "--save", save)],
                   env=env, timeout=300, check=True)
    text = log.read_text()
    assert "rc=0" not in text
    errors = [line for line in text.splitlines() if "pretrain_gpt.py: error" in line]
    assert len(errors) == 1, text[-3000:]
    # a full disk: ENOSPC, or torch's zip writer's "unexpected pos" with the free space short
    assert re.match(rf"pretrain_gpt.py: error: --save {re.escape(save)}: saving iteration 4 "
                    rf"failed: (\[Errno \d+\] )?{words}", errors[0]), errors[0]
    assert re.search(r"The checkpoint needs about [\d.]+ MiB \(\d+ bytes\); [\d.]+ MiB free "
                     "there", errors[0])
    assert "Traceback (most recent call last):\n  File \"" + str(REPO_ROOT) not in text
    assert sorted(os.listdir(out)) == [".lock", "iter_0000002", TRACKER]
    verify_shards(read_common_state(str(out))[1])  # the last checkpoint, whole


def test_a_save_longer_than_torchruns_grace_is_warned_about(monkeypatch):
    from megatron_ulysses.training import processes

    monkeypatch.setattr(processes, "_warned_grace", False)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "60")
    assert processes.save_beyond_grace(59.0) is None
    warning = processes.save_beyond_grace(61.0)
    assert "took 61 s" in warning and "60 s after forwarding a SIGTERM" in warning
    assert "--shutdown-timeout" in warning
    assert processes.save_beyond_grace(100.0) is None  # once
