"""Build the embedded ``data/digits`` dataset in torchvision ImageFolder layout.

Loads the UCI handwritten digits (8x8 grayscale, values 0..16, 10 classes) from
scikit-learn, scales them to 8-bit and writes one PNG per sample to
``data/digits/{train,val}/{label}/{index:04d}.png``, where ``index`` is the
sample's position in the scikit-learn array.

The train/val split is stratified and fixed: exactly 361 samples go to val,
allotted to classes proportionally with largest-remainder rounding, and chosen
within each class with ``np.random.default_rng(0)``. Output is deterministic.

Usage (scikit-learn is needed only for this script)::

    python data/make_digits.py
"""

import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent / "digits"
NUM_VAL = 361
SEED = 0


def val_quotas(counts: np.ndarray, total_val: int) -> np.ndarray:
    """Allot ``total_val`` across classes proportionally (largest-remainder rounding)."""
    exact = counts * total_val / counts.sum()
    quotas = np.floor(exact).astype(np.int64)
    remainder = total_val - int(quotas.sum())
    # Largest fractional parts first; ties go to the lower class index (stable sort).
    order = np.argsort(-(exact - quotas), kind="stable")
    quotas[order[:remainder]] += 1
    return quotas


def split_indices(
    labels: np.ndarray,
    total_val: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Return sorted (train, val) sample indices for a fixed stratified split."""
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    quotas = val_quotas(counts, total_val)
    val: list[np.ndarray] = []
    for cls, quota in zip(classes, quotas):
        members = np.flatnonzero(labels == cls)
        val.append(rng.permutation(members)[:quota])
    val_idx = np.sort(np.concatenate(val))
    train_idx = np.setdiff1d(np.arange(len(labels)), val_idx)
    return train_idx, val_idx


def to_uint8(image: np.ndarray) -> np.ndarray:
    """Scale an 8x8 image with values 0..16 to 0..255 via ``round(v * 255 / 16)``."""
    return np.round(image * 255 / 16).astype(np.uint8)


def write_split(
    name: str,
    indices: np.ndarray,
    images: np.ndarray,
    labels: np.ndarray,
) -> dict[int, int]:
    """Write the samples of one split as PNG files; return per-class counts."""
    counts: dict[int, int] = {}
    for idx in indices:
        label = int(labels[idx])
        folder = ROOT / name / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(to_uint8(images[idx]))  # 2-D uint8 -> mode "L"
        img.save(folder / f"{idx:04d}.png", format="PNG", optimize=False)
        counts[label] = counts.get(label, 0) + 1
    return counts


def main() -> None:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("scikit-learn is required to build data/digits: pip install scikit-learn")
        sys.exit(1)

    digits = load_digits()
    images = np.asarray(digits.images)
    labels = np.asarray(digits.target)

    train_idx, val_idx = split_indices(labels, NUM_VAL, SEED)

    if ROOT.exists():
        shutil.rmtree(ROOT)

    for name, indices in (("train", train_idx), ("val", val_idx)):
        counts = write_split(name, indices, images, labels)
        per_class = " ".join(f"{c}:{counts.get(c, 0)}" for c in range(10))
        print(f"{name}: {len(indices)} images ({per_class})")


if __name__ == "__main__":
    main()
