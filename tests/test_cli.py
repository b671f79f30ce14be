"""The ``dpzero privacy`` command against dp-accounting called directly; bad flags get errors naming the flag."""

import re
import subprocess
import sys

import dp_accounting
import pytest

from dpzero_jax.cli import main


def direct_epsilon(sigma, q, steps, delta):
    accountant = dp_accounting.pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(delta)


def test_privacy_prints_epsilon(capsys):
    assert main(["privacy", "--noise-multiplier", "1.1", "--sampling-rate", "0.01", "--steps", "1000",
                 "--delta", "1e-5"]) == 0
    printed = float(re.search(r"epsilon = ([0-9.]+)", capsys.readouterr().out).group(1))
    assert printed == pytest.approx(direct_epsilon(1.1, 0.01, 1000, 1e-5), rel=1e-3)


def test_privacy_calibrates_sigma(capsys):
    assert main(["privacy", "--epsilon", "3", "--sampling-rate", "0.01", "--steps", "1000"]) == 0
    sigma = float(re.search(r"noise multiplier ([0-9.]+)", capsys.readouterr().out).group(1))
    assert direct_epsilon(sigma, 0.01, 1000, 1e-5) == pytest.approx(3.0, rel=0.02)


@pytest.mark.parametrize("flag, value", [("--sampling-rate", "1.5"), ("--sampling-rate", "x"), ("--steps", "-1"),
                                         ("--delta", "1"), ("--noise-multiplier", "-2")])
def test_bad_values_name_the_flag(flag, value, capsys):
    args = {"--noise-multiplier": "1.0", "--sampling-rate": "0.01", "--steps": "10", "--delta": "1e-5"}
    args[flag] = value
    with pytest.raises(SystemExit) as exit_info:
        main(["privacy"] + [item for pair in args.items() for item in pair])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "dpzero_jax", "privacy", "--noise-multiplier", "1.0",
                          "--sampling-rate", "0.01", "--steps", "100"], capture_output=True, text=True, check=True)
    assert "epsilon =" in out.stdout


def test_plan_command_prints_per_device_bytes(capsys):
    assert main(["plan", "--model", "gpt2-xl", "--devices", "8", "--batch", "16", "--seq", "1024",
                 "--precision", "bf16", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state" in out and "12 (master, m, v) x Psi / N" in out
    assert main(["plan", "--model", "gpt2-xl", "--devices", "8"]) == 2
    assert "--batch is required" in capsys.readouterr().err
