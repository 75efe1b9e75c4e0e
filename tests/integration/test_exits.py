"""No exit path hangs. An exception planted (tests/helpers/plant.py, loaded through
MEGATRON_ULYSSES_FAULT_HOOK) before the first step, in a step, during a save and during an
evaluation, on one rank or several, with the helpers running (DataLoader workers, TensorBoard,
W&B offline, the async checkpoint writer): the job exits within seconds with one line naming
the error, where the run stopped and the last complete checkpoint; no process of it is left;
that checkpoint is whole and a run resumes from it. A full disk during a save (ENOSPC, also in
the async writer) is one message naming --save and the bytes needed. Ctrl-C is one line and
exit status 130. And W&B: a missing API key is refused before the process groups, a failed
`wandb.init` continues without W&B or stops, as --wandb-init-failure says.
"""

import json
import os
import re
import subprocess
import sys
import time
from unittest import mock

import launcher
import pytest
from conftest import REPO_ROOT
from test_cli import MODEL
from test_faults import wait_for

from megatron_ulysses.errors import ConfigError
from megatron_ulysses.training import exits, wandb_run

PLANT = REPO_ROOT / "tests" / "helpers" / "plant.py"
RUN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--log-interval",
       "1", "--mock-data", "--vocab-size", "256", "--train-iters", "6", "--save-interval", "2",
       "--eval-interval", "3", "--eval-iters", "1", "--num-workers", "2"]
LAST = "the last complete checkpoint is iteration 2 in --save {save} (resume with --load {save})"
PROMPT_S = 20  # from the fault to the job's end, on a loaded 2-core machine


def _env(tmp_path, plant: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="offline",
                **{exits.HOOK_ENV: str(PLANT)}, PLANT=plant, PLANT_DIR=str(tmp_path))


def _left_behind(tmp_path) -> list:
    """The planted ranks' processes and their descendants still alive (not zombies)."""
    pids = []
    for record in tmp_path.glob("rank*.json"):
        found = json.loads(record.read_text())
        pids += [found["pid"], *found["descendants"]]
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def _planted_at(tmp_path) -> float:
    return min(json.loads(r.read_text())["time"] for r in tmp_path.glob("rank*.json"))


def _assert_last_checkpoint_whole(save: str) -> None:
    from megatron_ulysses.training.checkpoint.load import read_common_state
    from megatron_ulysses.training.checkpoint.save_guard import verify_shards

    # a failed save's staging directory may stay (the next save removes it); nothing named
    # like a checkpoint but the last complete one
    assert sorted(n for n in os.listdir(save) if re.fullmatch(r"iter_\d+(\.old)?", n)) == [
        "iter_0000002"]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "2"
    verify_shards(read_common_state(save)[1])


CASES = [  # (ranks, phase, iteration, planted on, extra flags, where the line says it stopped)
    (1, "setup", 0, "0", ["--wandb-project", "p", "--wandb-exp-name", "e"],
     "before the first step"),
    (2, "step", 3, "1", [], "in iteration 3"),
    (2, "save", 4, "0", [], "saving iteration 4"),
    # the async save's files are committed at a later iteration's finalize step
    (2, "save", 4, "0", ["--async-save", "--use-persistent-ckpt-worker"],
     "(in iteration [56]|saving iteration 6)"),
    (1, "evaluate", 3, "0", ["--wandb-project", "p", "--wandb-exp-name", "e"],
     "evaluating after iteration 3"),
]


@pytest.mark.parametrize("nproc, phase, iteration, ranks, flags, where", CASES,
                         ids=[f"{c[1]}-{c[0]}rank" + ("-async" if c[4][:1] == ["--async-save"]
                                                     else "") for c in CASES])
def test_an_unexpected_error_ends_the_job_promptly_and_keeps_the_checkpoint(
        tmp_path, nproc, phase, iteration, ranks, flags, where):
    save = str(tmp_path / "save")
    result = launcher.pretrain(nproc, [*MODEL, *RUN, "--save", save, "--tensorboard-dir",
                                       str(tmp_path / "tb"), *flags],
                               env=_env(tmp_path, f"{phase}:{iteration}:{ranks}:error"),
                               timeout=120)
    ended = time.time()
    assert result.returncode == 1, result.stderr[-3000:]
    assert ended - _planted_at(tmp_path) < PROMPT_S
    lines = [line for line in result.stderr.splitlines() if "pretrain_gpt.py: error" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    assert re.match(rf"pretrain_gpt.py: error: RuntimeError on rank {ranks}: planted fault",
                    lines[0]), lines[0]
    assert re.search(f"stopped {where}; ", lines[0]), lines[0]
    wait_for(lambda: not _left_behind(tmp_path), 10, "the job's processes to end")
    if phase == "setup":
        assert lines[0].endswith(f"--save {save} holds no complete checkpoint")
        return
    assert lines[0].endswith(LAST.format(save=save))
    _assert_last_checkpoint_whole(save)
    if phase == "save":  # the checkpoint it left trains on
        resumed = launcher.pretrain(nproc, [*MODEL, *RUN, "--load", save, "--exit-interval",
                                            "3", "--num-workers", "0"], timeout=120)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "iteration        3/" in resumed.stdout


@pytest.mark.parametrize("nproc, flags", [(1, []), (2, ["--async-save",
                                                        "--use-persistent-ckpt-worker"])],
                         ids=["sync-1rank", "async-2ranks"])
def test_a_full_disk_during_a_save_is_one_message_with_the_bytes(tmp_path, nproc, flags):
    save = str(tmp_path / "save")
    ranks = ",".join(map(str, range(nproc)))
    result = launcher.pretrain(nproc, [*MODEL, *RUN, "--save", save, *flags],
                               env=_env(tmp_path, f"save:4:{ranks}:enospc"), timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "pretrain_gpt.py: error" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    assert re.match(rf"pretrain_gpt.py: error: --save {re.escape(save)}: saving iteration 4 "
                    r"failed: \[Errno 28\] No space left on device", lines[0]), lines[0]
    assert re.search(r"needs about [\d.]+ MiB \(\d+ bytes\)", lines[0]), lines[0]
    assert "Traceback" not in result.stderr
    wait_for(lambda: not _left_behind(tmp_path), 10, "the job's processes to end")
    _assert_last_checkpoint_whole(save)


CTRL_C = [  # (ranks, where planted, flags, where the line says it stopped)
    (1, "step:4", [], "in iteration 4"),
    (2, "step:4", [], "in iteration 4"),
    # from the async writer, mid-write: the rank trains on until the signal reaches it
    (1, "save:4", ["--async-save", "--use-persistent-ckpt-worker"], r"(in|saving) iteration \d"),
]


@pytest.mark.parametrize("nproc, plant, flags, where", CTRL_C,
                         ids=["1rank", "torchrun-2ranks", "1rank-async-writer"])
def test_ctrl_c_is_one_line_naming_the_last_checkpoint(tmp_path, nproc, plant, flags, where):
    """SIGINT as a terminal sends it: to the whole job (one process, no torchrun), or to
    torchrun, which forwards it to the ranks (its own status is then 1, with its traceback)."""
    save = str(tmp_path / "save")
    script = [str(REPO_ROOT / "pretrain_gpt.py"), *MODEL, *RUN, "--save", save, *flags]
    command = ([sys.executable, *script] if nproc == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", *script])
    result = subprocess.run(command, env=_env(tmp_path, f"{plant}:0:sigint"),
                            capture_output=True, text=True, timeout=120, start_new_session=True)
    assert time.time() - _planted_at(tmp_path) < PROMPT_S
    lines = [line for line in result.stderr.splitlines()
             if "pretrain_gpt.py:" in line and "warning:" not in line]
    assert len(lines) == 1 and re.fullmatch(
        rf"pretrain_gpt.py: interrupted \(SIGINT\); stopped {where}; "
        rf"{re.escape(LAST.format(save=save))}", lines[0]), result.stderr[-3000:]
    assert "KeyboardInterrupt" not in result.stderr
    if nproc == 1:
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == (130 if nproc == 1 else 1), result.stderr[-3000:]
    wait_for(lambda: not _left_behind(tmp_path), 10, "the job's processes to end")
    _assert_last_checkpoint_whole(save)


# --- W&B ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, words", [(None, "W&B has no API key"),
                                        ("short", "WANDB_API_KEY invalid")])
def test_wandb_without_an_api_key_is_refused_before_the_process_groups(tmp_path, key, words):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if key:
        env["WANDB_API_KEY"] = key
    result = launcher.pretrain(1, [*MODEL, *RUN, "--save", str(tmp_path / "save"),
                                   "--wandb-project", "p", "--wandb-exp-name", "e"], env=env,
                               timeout=120)
    assert result.returncode == 1  # torchrun's, after the rank's 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"pretrain_gpt.py: error: --wandb-project p: {words}")
    for fix in ("`wandb login`", "WANDB_API_KEY", "WANDB_MODE=offline"):
        assert fix in lines[0]
    assert "iteration" not in result.stdout and "world" not in result.stdout


def test_a_failed_wandb_init_trains_on_and_the_job_ends(tmp_path):
    """W&B online with a key but no server (a compute node): one warning, the run trains to the
    end and exits; nothing the failed init keeps alive keeps the DataLoader workers waited on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               WANDB_API_KEY="a" * 40, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_INIT_TIMEOUT="1")
    result = launcher.pretrain(1, [*MODEL, *RUN, "--save", str(tmp_path / "save"),
                                   "--wandb-project", "p", "--wandb-exp-name", "e"], env=env,
                               timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING: --wandb-project p: wandb.init failed (" in result.stdout
    assert "Training goes on without W&B" in result.stdout
    assert "iteration        6/" in result.stdout


class _Logging:
    wandb_project, wandb_entity, wandb_exp_name, wandb_save_dir = "p", None, "e", "/nonexistent"


@pytest.mark.parametrize("policy", ["continue", "exit"])
def test_a_failed_wandb_init_continues_or_stops_as_the_flag_says(capsys, policy):
    logging = _Logging()
    logging.wandb_init_failure = policy
    failure = TimeoutError("Run initialization has timed out after 90.0 sec.\nmore")
    with mock.patch("wandb.init", side_effect=failure):
        if policy == "exit":
            with pytest.raises(ConfigError, match=r"wandb.init failed \(TimeoutError: Run "
                               r"initialization has timed out after 90.0 sec.\)\. The run stops "
                               r"\(--wandb-init-failure exit\)"):
                wandb_run.start(logging, {})
            return
        assert wandb_run.start(logging, {}) is None
    out = capsys.readouterr().out
    assert "WARNING: --wandb-project p: wandb.init failed (TimeoutError" in out
    assert "Training goes on without W&B (--wandb-init-failure continue" in out


def test_a_wandb_run_that_did_not_start_keeps_the_timers_collectives():
    from megatron_ulysses.training import writers as module

    class Config:
        class logging:
            tensorboard_dir, wandb_project = None, "p"

    with mock.patch.object(wandb_run, "start", return_value=None), \
            mock.patch.object(module, "_flat_config", return_value={}):
        writers = module.ScalarWriters(Config)
    assert writers.wandb is None and writers.timer_writers() == [None]
