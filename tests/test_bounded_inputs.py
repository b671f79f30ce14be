"""Issue 21, part 3: absurd inputs answer in seconds or are refused with the reason; file errors name file and line."""

import time

import dp_accounting
import pytest

from dpzero_jax import accounting, planner, text
from dpzero_jax.cli import main


def _privacy(argv, capsys):
    start = time.perf_counter()
    code = main(["privacy", *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err, time.perf_counter() - start


def test_huge_step_count_is_refused_for_pld_and_answered_by_rdp(capsys):
    code, text_, seconds = _privacy(["--noise-multiplier", "1", "--sampling-rate", "0.01", "--steps",
                                     "100000000000"], capsys)
    assert code == 2 and "--accountant rdp" in text_ and seconds < 5
    code, text_, seconds = _privacy(["--noise-multiplier", "1", "--sampling-rate", "0.01", "--steps",
                                     "100000000000", "--accountant", "rdp"], capsys)
    assert code == 0 and "epsilon =" in text_ and seconds < 5


def test_tiny_noise_is_answered_clearly(capsys, tmp_path):
    code, text_, seconds = _privacy(["--noise-multiplier", "1e-9", "--sampling-rate", "0.01", "--steps", "1000"],
                                    capsys)
    assert code == 2 and "no meaningful guarantee" in text_ and seconds < 5
    out = tmp_path / "out"
    assert main(["train", "--noise-multiplier", "1e-9", "--steps", "2", "--out", str(out), "--no-progress"]) == 2
    assert "no meaningful guarantee" in capsys.readouterr().err and not out.exists()


def test_huge_target_epsilon_is_refused_for_pld_and_calibrated_by_rdp(capsys, tmp_path):
    code, text_, seconds = _privacy(["--epsilon", "1000", "--sampling-rate", "0.01", "--steps", "1000"], capsys)
    assert code == 2 and "limit" in text_ and seconds < 5
    sigma = accounting.calibrate_noise(1000, 0.01, 1000, 1e-5, accountant="rdp")
    rdp = dp_accounting.rdp.RdpAccountant()   # independent check of the answer with dp_accounting itself
    rdp.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(sigma)), 1000))
    assert rdp.get_epsilon(1e-5) <= 1000
    out = tmp_path / "out"
    assert main(["train", "--epsilon", "1000", "--steps", "2", "--out", str(out), "--no-progress"]) == 2
    assert "limit" in capsys.readouterr().err and not out.exists()


def test_max_steps_beyond_the_pld_limits_stays_conservative():
    # sigma 1e-9: one step already costs more than any target
    assert accounting.max_steps(1e-9, 0.01, 3.0, 1e-5) == 0
    with pytest.raises(ValueError, match="limit"):
        accounting.max_steps(1.0, 0.01, 1000.0, 1e-5)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_step_count_messages_agree(value, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--steps", value])
    assert f"--steps must be an integer >= 1, got '{value}'" in capsys.readouterr().err


def test_non_utf8_config_names_file_and_line(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_bytes(b"steps: 2\nlr: \x85\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "line 2" in err and "0x85" in err


def test_non_utf8_data_names_file_and_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl.*line 2"):
        text.read_examples(data, task="causal-lm")


def test_plan_accepts_a_save_pretrained_gpt2_config(tmp_path):
    import json

    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32).save_pretrained(tmp_path)
    config = planner.resolve_model(str(tmp_path / "config.json"))
    assert (config.n_layer, config.d_model, config.n_head, config.vocab, config.n_ctx) == (2, 64, 4, 100, 32)
    assert "activation_function" in json.loads((tmp_path / "config.json").read_text())
