"""Fashion-MNIST from its original IDX ``.gz`` files or the Kaggle CSV, or a learnable synthetic stand-in.

Nothing is downloaded: without a path, :func:`load_fashion_mnist` builds a synthetic dataset of the same
shape (10 classes of 28x28 uint8 images, each class a smooth random template plus noise and shifts), so
every example runs offline and a model's loss falls on it.
"""

from __future__ import annotations

import gzip
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..errors import DataError, InvalidInputError

__all__ = ["Dataset", "load_fashion_mnist", "synthetic_fashion_mnist", "read_idx", "read_csv"]

_IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_CSV_FILES = {"train": "fashion-mnist_train.csv", "test": "fashion-mnist_test.csv"}


@dataclass(frozen=True)
class Dataset:
    """Images ``(N, 1, 28, 28)`` uint8 and labels ``(N,)`` int64, with where they came from."""

    images: torch.Tensor
    labels: torch.Tensor
    source: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, n: int) -> Dataset:
        """The first ``n`` images and labels (all of them where there are fewer)."""
        if n >= len(self):  # all of them: the label says no "(first 2048)" of a file of 100
            return self
        return Dataset(self.images[:n], self.labels[:n], f"{self.source} (first {n})")

    def batches(
        self, batch_size: int, *, shuffle: bool = True, seed: int = 0, device: str | torch.device = "cpu"
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(images float32 in [0, 1], labels)`` batches; the order depends only on ``seed``."""
        if batch_size < 1:
            raise InvalidInputError(f"Dataset.batches: batch_size must be >= 1, got {batch_size}.")
        n = len(self)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(n)
        for start in range(0, n, batch_size):
            index = order[start : start + batch_size]
            yield self.images[index].float().div_(255).to(device), self.labels[index].to(device)


def load_fashion_mnist(path: str | os.PathLike | None = None, split: str = "train") -> Dataset:
    """Load Fashion-MNIST's ``split`` ("train" or "test").

    Args:
        path: a directory holding the original ``*-idx?-ubyte.gz`` files or the Kaggle CSVs
            (``fashion-mnist_train.csv``, ``fashion-mnist_test.csv``); a single ``.csv`` file; or None for the
            built-in synthetic dataset (60,000 train / 10,000 test images).

    Raises:
        DataError: the path does not exist, holds neither format, or a file is malformed (the message names
            the file and what was expected).
    """
    if split not in _IDX_FILES:
        raise InvalidInputError(f"memtrim.data.load_fashion_mnist: split must be 'train' or 'test', got {split!r}.")
    if path is None:
        return synthetic_fashion_mnist(60_000 if split == "train" else 10_000, seed=0 if split == "train" else 1)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(
            f"memtrim.data: {path} does not exist. Expected a directory with Fashion-MNIST's IDX .gz files or "
            "Kaggle CSVs, or a .csv file; or pass no path for the synthetic dataset."
        )
    if os.path.isfile(path):
        if not path.endswith(".csv"):
            raise DataError(f"memtrim.data: {path} is a file but not a .csv; pass the directory of the IDX .gz files.")
        return read_csv(path)
    images_name, labels_name = _IDX_FILES[split]
    images_path, labels_path = os.path.join(path, images_name), os.path.join(path, labels_name)
    if os.path.exists(images_path) or os.path.exists(labels_path):
        images = read_idx(images_path, expected_dims=3)
        labels = read_idx(labels_path, expected_dims=1)
        if images.shape[0] != labels.shape[0]:
            raise DataError(
                f"memtrim.data: {images_path} holds {images.shape[0]} images but {labels_path} holds "
                f"{labels.shape[0]} labels; the two files must come from the same split."
            )
        _check_images(images, images_path)
        _check_labels(labels, labels_path)
        return Dataset(images.unsqueeze(1), labels.long(), f"Fashion-MNIST IDX {split} ({path})")
    csv_path = os.path.join(path, _CSV_FILES[split])
    if os.path.exists(csv_path):
        return read_csv(csv_path)
    raise DataError(
        f"memtrim.data: {path} holds neither {images_name} + {labels_name} nor {_CSV_FILES[split]} "
        f"(Fashion-MNIST's {split} split)."
    )


def read_idx(path: str, expected_dims: int | None = None) -> torch.Tensor:
    """Read an IDX file of unsigned bytes (gzip-compressed or not) into a uint8 tensor."""
    if not os.path.exists(path):
        raise DataError(f"memtrim.data: {path} does not exist (expected an IDX file).")
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"memtrim.data: cannot read {path} as a gzip-compressed IDX file: {e}.") from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"memtrim.data: {path} is not an IDX file (expected the magic bytes 00 00 08 0N).")
    if data[2] != 0x08:
        raise DataError(f"memtrim.data: {path} has element type 0x{data[2]:02x}; expected 0x08 (unsigned byte).")
    dims = data[3]
    if expected_dims is not None and dims != expected_dims:
        raise DataError(f"memtrim.data: {path} has {dims} dimensions; expected {expected_dims}.")
    header = 4 + 4 * dims
    if len(data) < header:
        raise DataError(f"memtrim.data: {path} is truncated inside its header.")
    shape = struct.unpack(f">{dims}I", data[4:header])
    count = 1
    for size in shape:
        count *= size
    if len(data) - header != count:
        raise DataError(
            f"memtrim.data: {path} declares shape {tuple(shape)} ({count} bytes) but holds {len(data) - header} "
            "bytes of data; the file is truncated or corrupt."
        )
    return torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8).reshape(shape)


def read_csv(path: str) -> Dataset:
    """Read the Kaggle CSV (header ``label,pixel1,...,pixel784``, one image per row, values 0-255)."""
    import numpy as np

    try:
        with open(path) as f:
            header = f.readline().strip().split(",")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"memtrim.data: cannot read {path}: {e}.") from e
    expected = ["label"] + [f"pixel{i}" for i in range(1, 785)]
    if header != expected:
        raise DataError(
            f"memtrim.data: {path} has header {','.join(header[:3])}... with {len(header)} columns; expected "
            "label,pixel1,...,pixel784 (785 columns), the Kaggle Fashion-MNIST CSV."
        )
    try:
        table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    except ValueError as e:
        raise DataError(f"memtrim.data: {path} has a malformed row ({e}); expected 785 integers per row.") from e
    if table.shape[0] == 0:
        raise DataError(f"memtrim.data: {path} has a header but no rows.")
    if table.shape[1] != 785:
        raise DataError(f"memtrim.data: {path} has rows of {table.shape[1]} values; expected 785.")
    images = torch.from_numpy(table[:, 1:])
    labels = torch.from_numpy(table[:, 0])
    if images.min() < 0 or images.max() > 255:
        raise DataError(f"memtrim.data: {path} has pixel values outside 0-255.")
    _check_labels(labels, path)
    return Dataset(images.to(torch.uint8).reshape(-1, 1, 28, 28), labels.long(), f"Fashion-MNIST CSV ({path})")


def synthetic_fashion_mnist(n: int = 60_000, *, seed: int = 0, num_classes: int = 10) -> Dataset:
    """A learnable stand-in with Fashion-MNIST's shapes: class templates (smooth random blobs) + noise."""
    if n < 1:
        raise InvalidInputError(f"memtrim.data.synthetic_fashion_mnist: n must be >= 1, got {n}.")
    templates_gen = torch.Generator().manual_seed(1234)  # the classes are the same for every split
    coarse = torch.rand(num_classes, 1, 7, 7, generator=templates_gen)
    templates = torch.nn.functional.interpolate(coarse, size=(28, 28), mode="bilinear", align_corners=False)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (n,), generator=gen)
    # each image: its class template, a little of a random other class, contrast jitter, noise, a small shift
    other = torch.randint(0, num_classes, (n,), generator=gen)
    images = templates[labels] * (0.5 + 0.5 * torch.rand(n, 1, 1, 1, generator=gen)) + 0.6 * templates[other]
    images = images + 0.35 * torch.randn(n, 1, 28, 28, generator=gen)
    shifts = torch.randint(-3, 4, (n, 2), generator=gen)
    for dx in range(-3, 4):
        for dy in range(-3, 4):
            chosen = (shifts[:, 0] == dx) & (shifts[:, 1] == dy)
            images[chosen] = torch.roll(images[chosen], shifts=(dx, dy), dims=(2, 3))
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    return Dataset(images, labels, f"synthetic Fashion-MNIST stand-in (n={n}, seed={seed})")


def _check_images(images: torch.Tensor, path: str) -> None:
    if tuple(images.shape[1:]) != (28, 28):
        raise DataError(f"memtrim.data: {path} holds images of {tuple(images.shape[1:])}; expected 28x28.")


def _check_labels(labels: torch.Tensor, path: str) -> None:
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) > 9):
        raise DataError(f"memtrim.data: {path} has labels outside 0-9.")
