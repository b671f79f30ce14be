"""Where a training run's metric rows go besides ``metrics.jsonl``: TensorBoard event files and Weights & Biases.

A row is the dict the trainer writes to ``metrics.jsonl`` (``step``, ``loss``, ``epsilon``, ``lr``, evaluation
fields, ...). Every writer logs its numeric fields at ``row["step"]``; ``None`` and non-numeric values are skipped.

* ``"tensorboard"``: event files under ``<out>/tensorboard`` through ``tensorboardX`` (``pip install
  'dpzero_jax[tensorboard]'``), scalars named as the row's keys. A resumed run writes a new event file that tells
  TensorBoard to drop the earlier files' events from the resumed step on (``purge_step``), so rows recomputed after
  the last checkpoint are not shown twice. Local output directories only.
* ``"wandb"``: ``wandb.log(row, step=row["step"])`` in a run initialised with the training config, in the project
  given, resumed by run id (``<out>/wandb_run_id``) after a restart. Needs ``wandb`` installed and logged in.

Only the first process writes (as for ``metrics.jsonl``).
"""

from __future__ import annotations

import numbers
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from dpzero_jax import rundir, validation

WRITERS = ("tensorboard", "wandb")


def _scalars(row: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)}


class TensorBoardWriter:
    """Scalars of each row into ``logdir``'s event files (``purge_step``: the first step this process writes)."""

    def __init__(self, logdir, purge_step: int | None = None):
        tensorboardx = validation.import_optional("tensorboardX", "tensorboard", "TensorBoard event files")
        self._writer = tensorboardx.SummaryWriter(logdir=str(logdir), purge_step=purge_step)

    def write(self, row: Mapping[str, Any]) -> None:
        for name, value in _scalars(row).items():
            self._writer.add_scalar(name, value, global_step=int(row["step"]))

    def sync(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """Each row to a W&B run of ``project``; the run id is kept in ``id_file`` so that a resumed run continues it."""

    def __init__(self, project: str, config: Mapping[str, Any], id_file, directory):
        wandb = validation.import_optional("wandb", "wandb", "Weights & Biases logging")
        id_file = rundir.as_path(id_file)
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:16]
        if not id_file.exists():
            id_file.write_text(run_id)
        self._run = wandb.init(project=project, id=run_id, resume="allow", config=dict(config), dir=str(directory))

    def write(self, row: Mapping[str, Any]) -> None:
        self._run.log(_scalars(row), step=int(row["step"]))

    def sync(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


def check(names: Sequence[str], out, wandb_project: str | None) -> None:
    """Refuse what cannot work before training starts: unknown writers, W&B without a project, TensorBoard on an
    object store."""
    for name in names:
        if name not in WRITERS:
            raise ValueError(f"metric writer {name!r}: expected one of {WRITERS}")
    if "wandb" in names and not wandb_project:
        raise ValueError("the 'wandb' metric writer needs a project (TrainConfig.wandb_project / --wandb PROJECT)")
    if "tensorboard" in names and rundir.is_remote(rundir.as_path(out)):
        raise ValueError(f"--tensorboard writes event files into a local output directory, not {out}; write them "
                         f"locally and copy them, or use --wandb")


def open_writers(names: Sequence[str], out, *, config: Mapping[str, Any], wandb_project: str | None,
                 first_step: int) -> list:
    """The writers asked for, opened for a run in ``out`` whose first new row has step ``first_step``."""
    check(names, out, wandb_project)
    out = rundir.as_path(out)
    writers = []
    for name in names:
        if name == "tensorboard":
            writers.append(TensorBoardWriter(out / "tensorboard", purge_step=first_step if first_step > 1 else None))
        else:
            writers.append(WandbWriter(wandb_project, config, out / "wandb_run_id", out))
    return writers
