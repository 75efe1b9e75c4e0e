"""tools/plot_run.py: log and TensorBoard parsing, the PNG, and its error exits."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "plot_run.py"
sys.path.insert(0, str(REPO_ROOT / "tools"))

import plot_run  # noqa: E402

ITERS = [10, 20, 30, 40]
LOSS = [5.123456, 4.5, 4.0123, 3.75]
LR = [2.5e-4, 5.0e-4, 4.5e-4, 3.0e-4]
TPS = [5321.2, 5400.0, 5391.7, 5402.5]
MEM = [0.51, 0.52, 0.52, 0.53]
VAL = {20: 4.6, 40: 3.9}


def train_line(it, loss, lr, tps, mem, total=100):
    return (
        f" [2026-12-02 23:59:01] iteration {it:8d}/{total:8d} | consumed samples: {16 * it:12d} | "
        f"elapsed time per iteration (ms): 123.4 | throughput (tokens/s): {tps:.1f} | "
        f"TFLOP/s per GPU: 0.05 | learning rate: {lr:E} | global batch size: {16:5d} | "
        f"lm loss: {loss:E} | loss scale: 1.0 | grad norm: 1.234 | peak memory (GiB): {mem:.2f} | "
        f"number of skipped iterations: {0:3d} | number of nan iterations: {0:3d} | ETA: 0:01:23 |"
    )


def write_log(path: Path, with_validation=True) -> Path:
    lines = ["using world size: 8, data-parallel size: 1, ulysses sp size: 8",
             "> building GPT model ...", "[rank0]: some warning | with: pipes"]
    for it, loss, lr, tps, mem in zip(ITERS, LOSS, LR, TPS, MEM):
        lines.append(train_line(it, loss, lr, tps, mem))
        if with_validation and it in VAL:
            lines += ["-" * 80,
                      f" validation loss at iteration {it} | lm loss value: {VAL[it]:E} | "
                      f"lm loss PPL: 1.0E+02 | ",
                      "-" * 80]
    lines.append(" validation loss at iteration 40 on test set | lm loss value: 9.9E+00 | ")
    path.write_text("\n".join(lines) + "\n")
    return path


def series(values):
    return list(zip(ITERS, values))


def run_cli(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_parse_log_series_equal_what_was_written(tmp_path):
    run = plot_run.parse_log(write_log(tmp_path / "train.log"))
    assert run == {
        "loss": series(LOSS), "lr": series(LR), "throughput": series(TPS),
        "memory": series(MEM), "val_loss": sorted(VAL.items()),
    }


def test_parse_line_fields_and_non_iteration_lines():
    kind, it, values = plot_run.parse_line(train_line(10, 5.0, 1e-4, 100.0, 1.5))
    assert (kind, it) == ("train", 10)
    assert values["lm loss"] == 5.0 and values["learning rate"] == 1e-4
    assert values["number of nan iterations"] == 0 and "ETA" not in values
    assert plot_run.parse_line("[rank0]: " + train_line(7, 1, 1, 1, 1))[1] == 7
    assert plot_run.parse_line(" validation loss at iteration 5 | lm loss value: 2.0E+00 |") == (
        "validation", 5, {"lm loss value": 2.0})


@pytest.mark.parametrize("line", [
    "", "saving checkpoint at iteration 10 to ckpt", "random | text: 1 |",
    " validation loss at iteration 5 on test set | lm loss value: 2.0 |",
])
def test_other_lines_are_not_parsed(line):
    assert plot_run.parse_line(line) is None


def test_missing_metrics_unknown_keys_and_repeated_iterations(tmp_path):
    log = tmp_path / "partial.log"
    log.write_text(
        " iteration 1/ 3 | lm loss: 3.0E+00 | new metric: 7 | learning rate: 1.0E-04 |\n"
        " iteration 2/ 3 | lm loss: nan | learning rate: 1.0E-04 |\n"
        " iteration 2/ 3 | lm loss: 2.0E+00 | learning rate: 2.0E-04 |\n"  # resumed run
    )
    assert plot_run.parse_log(log) == {"loss": [(1, 3.0), (2, 2.0)],
                                       "lr": [(1, 1e-4), (2, 2e-4)]}
    out = tmp_path / "partial.png"
    assert plot_run.main([str(log), "--output", str(out)]) == 0
    assert out.stat().st_size > 0


def test_tensorboard_dir_matches_log(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    tb_dir = tmp_path / "tensorboard"
    writer = SummaryWriter(log_dir=str(tb_dir))
    for it, loss, lr, tps, mem in zip(ITERS, LOSS, LR, TPS, MEM):
        writer.add_scalar("lm loss", loss, it)
        writer.add_scalar("learning-rate", lr, it)
        writer.add_scalar("throughput/tokens-per-sec", tps, it)
        writer.add_scalar("memory/peak-GiB", mem, it)
        writer.add_scalar("grad-norm", 1.0, it)
        if it in VAL:
            writer.add_scalar("validation/lm loss", VAL[it], it)
    writer.close()
    tb_run = plot_run.read_tensorboard(tb_dir)
    log_run = plot_run.parse_log(write_log(tmp_path / "train.log"))
    assert tb_run.keys() == log_run.keys()
    for key, points in log_run.items():  # TensorBoard stores float32
        assert [it for it, _ in tb_run[key]] == [it for it, _ in points]
        assert [v for _, v in tb_run[key]] == pytest.approx([v for _, v in points], rel=1e-6)
    assert plot_run.load_run(tmp_path) == tb_run  # one nested event dir is found

    out = tmp_path / "plots" / "both.png"
    result = run_cli(tmp_path / "train.log", tb_dir, "--labels", "log", "tb",
                     "--title", "sp8", "--output", out)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_main_writes_png_overlaying_runs(tmp_path, capsys):
    a = write_log(tmp_path / "a.log")
    b = write_log(tmp_path / "b.log", with_validation=False)
    out = tmp_path / "run.png"
    assert plot_run.main([str(a), str(b), "--output", str(out), "--title", "two runs"]) == 0
    assert out.exists() and out.stat().st_size > 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert plot_run.default_labels([str(a), str(b)]) == ["a.log", "b.log"]
    assert plot_run.default_labels(["x/tb", "y/tb"]) == ["x/tb", "y/tb"]


def test_missing_input_exits_2_naming_path(tmp_path):
    missing = tmp_path / "nope.log"
    result = run_cli(write_log(tmp_path / "ok.log"), missing, "--output", tmp_path / "x.png")
    assert result.returncode == 2
    assert str(missing) in result.stderr and "no such file" in result.stderr
    assert not (tmp_path / "x.png").exists()
    assert plot_run.main([str(missing), "--output", str(tmp_path / "y.png")]) == 2


def test_log_without_iteration_lines_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("> building GPT model ...\n"
                     " validation loss at iteration 1 | lm loss value: 1 |\n")
    with pytest.raises(plot_run.InputError, match="empty.log.*no iteration lines"):
        plot_run.parse_log(empty)
    assert plot_run.main([str(empty), "--output", str(tmp_path / "e.png")]) == 2
    assert str(empty) in capsys.readouterr().err
    assert not (tmp_path / "e.png").exists()


def test_labels_count_must_match_inputs(tmp_path):
    log = write_log(tmp_path / "a.log")
    with pytest.raises(SystemExit) as exc:
        plot_run.main([str(log), "--labels", "one", "two"])
    assert exc.value.code == 2


@pytest.mark.parametrize("output, words", [
    pytest.param("x.xyz", ["--output", "x.xyz", "'.xyz' is not an image format matplotlib writes",
                           ".png"], id="unknown-suffix"),
    pytest.param("plot", ["--output", "'plot' has no image suffix", "plot.png"], id="no-suffix"),
    pytest.param("adir", ["--output", "'adir' is a directory", "adir/run.png"], id="a-directory"),
    pytest.param("a.log/x.png", ["--output", "a.log/x.png", "cannot be written",
                                 "a writable --output"], id="under-a-file"),
])
def test_an_unwritable_output_is_one_message_and_writes_nothing(tmp_path, monkeypatch, capsys,
                                                                output, words):
    monkeypatch.chdir(tmp_path)
    write_log(tmp_path / "a.log")
    (tmp_path / "adir").mkdir()
    before = sorted(path.name for path in tmp_path.iterdir())
    try:
        code = plot_run.main(["a.log", "--output", output])
    except SystemExit as err:
        code = err.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert sorted(path.name for path in tmp_path.iterdir()) == before
    assert not any((tmp_path / "adir").iterdir())
