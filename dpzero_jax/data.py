"""Small bundled datasets for the training loop (no network access needed).

Each loader returns ``(train, test)``: dicts ``{"image": float32 [N, H, W, C], "label": int32 [N]}``.
"""

from __future__ import annotations

import numpy as np

DATASETS = ("digits",)


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """scikit-learn's bundled 8x8 digits (1797 examples, 10 classes), split with a fixed seed and standardised
    (scikit-learn comes with the ``train`` extra).

    The split is stratified and depends only on ``seed``; features are standardised with the TRAIN mean and
    standard deviation (per pixel; constant pixels keep std 1). Images are ``[N, 8, 8, 1]``.
    """
    from dpzero_jax.validation import import_optional

    datasets = import_optional("sklearn.datasets", "train", "the digits data set")
    train_test_split = import_optional("sklearn.model_selection", "train", "the digits data set").train_test_split
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    digits = datasets.load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                                        stratify=y)
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std = np.where(std > 1e-6, std, 1.0).astype(np.float32)

    def pack(xs, ys):
        images = ((xs - mean) / std).astype(np.float32).reshape(-1, 8, 8, 1)
        return {"image": np.ascontiguousarray(images), "label": np.ascontiguousarray(ys)}

    return pack(x_train, y_train), pack(x_test, y_test)


def load_dataset(name: str, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    if name == "digits":
        return load_digits(seed=seed)
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
