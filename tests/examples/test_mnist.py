"""examples/mnist/main.py: the program Lab 6's job commands run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.mnist import load_mnist

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "examples" / "mnist" / "main.py"
EPOCH_RE = re.compile(r"^epoch (\d+)/(\d+) loss=(\d+\.\d+) train_acc=(\d\.\d+) test_acc=(\d\.\d+)$")


def run(*args: str, gpus: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return subprocess.run(
        [sys.executable, str(MAIN), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


#: Whole training runs (seconds each): end to end, so `make test-fast` leaves them out.
training = pytest.mark.e2e


def epoch_lines(stdout: str) -> list[re.Match[str]]:
    return [m for line in stdout.splitlines() if (m := EPOCH_RE.match(line))]


@training
def test_two_epochs_print_one_line_each_and_exit_zero() -> None:
    proc = run("--epochs", "2", "--lr", "0.01", "--batch-size", "64", gpus="0,1")
    assert proc.returncode == 0, proc.stderr
    lines = epoch_lines(proc.stdout)
    assert [(m[1], m[2]) for m in lines] == [("1", "2"), ("2", "2")]
    assert "CUDA_VISIBLE_DEVICES: 0,1" in proc.stdout and "CPU" in proc.stdout


@training
def test_ten_epochs_at_lr_0_1_learn_the_digits() -> None:
    proc = run("--epochs", "10", "--lr", "0.1", "--batch-size", "64")
    assert proc.returncode == 0, proc.stderr
    lines = epoch_lines(proc.stdout)
    assert len(lines) == 10
    assert float(lines[-1][5]) > 0.90
    assert float(lines[-1][3]) < float(lines[0][3])  # the loss went down


load_main = load_mnist


def test_lab6_arguments_learn_the_digits_in_one_epoch(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Lab 6's job files run exactly this; plain SGD on raw pixels ended at chance (about 0.11).
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert load_main().main(["--epochs", "1", "--lr", "0.01", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    [line] = epoch_lines(out)
    final = re.search(r"^final test_acc=(\d\.\d+)$", out, re.MULTILINE)
    assert final is not None, out
    assert float(final[1]) == float(line[5]) >= 0.85


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epochs", "0"], "--epochs"),
        (["--lr", "abc"], "--lr"),
        (["--lr", "-1"], "--lr"),
        (["--batch-size", "1.5"], "--batch-size"),
        (["--bogus"], "unrecognized"),
    ],
)
def test_bad_arguments_exit_non_zero_with_a_message(args: list[str], message: str) -> None:
    proc = run(*args)
    assert proc.returncode != 0
    assert message in proc.stderr


@training
def test_diverging_loss_exits_non_zero() -> None:
    proc = run("--epochs", "1", "--lr", "1e300")
    assert proc.returncode == 1
    assert "diverged" in proc.stderr


def test_data_from_a_directory_and_the_model_out_to_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--export-data writes the set a user uploads; --data-dir reads it instead of scikit-learn's copy;
    --output-dir writes a model that load_model reads back and that scores as the run said."""
    import json

    import numpy as np

    mnist = load_main()
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    assert mnist.main(["--export-data", str(data / "digits.npz")]) == 0
    with np.load(data / "digits.npz") as f:
        pixels, labels = f["data"], f["target"]
    assert pixels.shape == (1797, 64) and labels.shape == (1797,)
    # A data set that differs from scikit-learn's proves the directory's was read: drop a tenth.
    np.savez(data / "digits.npz", data=pixels[:1617], target=labels[:1617])
    assert mnist.main(["--epochs", "1", "--lr", "0.01", "--data-dir", str(data), "--output-dir", str(out)]) == 0
    assert "1294 train / 323 test" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    predict = mnist.load_model(out / "model.npz")
    _, test = mnist.split(1617, 0, 0.2)
    accuracy = float((predict(pixels[:1617][test]) == labels[:1617][test]).mean())
    assert accuracy == pytest.approx(metrics["test_acc"]) and accuracy >= 0.85
