"""The training plot uses matplotlib's object API: the global backend and pyplot are left as the user had them."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
import matplotlib
matplotlib.use("pdf")                                  # the user's choice, which the plot must not change
from dpzero_jax.train import _plot
from matplotlib.image import imread

for name, eps in (("dp.png", [0.5, 0.9, 1.2]), ("nodp.png", [None, None, None])):
    _plot([{"step": s, "loss": 2.0 - s / 10, "epsilon": e} for s, e in zip((1, 2, 3), eps)], sys.argv[1] + name)
image = imread(sys.argv[1] + "dp.png")
print(json.dumps({"backend": matplotlib.get_backend(), "rc": matplotlib.rcParams["backend"],
                  "pyplot": "matplotlib.pyplot" in sys.modules, "shape": list(image.shape),
                  "ink": float((image[..., :3] < 0.5).mean())}))
"""


def test_plot_leaves_the_global_backend_alone(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, f"{tmp_path}/"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["backend"] == "pdf" and report["rc"] == "pdf"
    assert not report["pyplot"]                              # pyplot's global state never imported
    assert report["shape"] == [400, 1000, 4]                 # 10 x 4 inches at 100 dpi
    assert 0.001 < report["ink"] < 0.5                       # axes and curves were drawn
    assert (tmp_path / "nodp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_skipped_with_a_notice(tmp_path, monkeypatch, capsys):
    from dpzero_jax.train import _plot

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)   # import matplotlib... raises ModuleNotFoundError
    _plot([{"step": 1, "loss": 1.0, "epsilon": 0.5}], tmp_path / "training.png")
    assert not (tmp_path / "training.png").exists()
    notice = capsys.readouterr().err.strip()
    assert len(notice.splitlines()) == 1 and "matplotlib is not installed" in notice and "[plot]" in notice
