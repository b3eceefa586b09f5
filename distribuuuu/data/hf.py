"""A Hugging Face ``datasets`` image dataset saved with ``save_to_disk``, as TRAIN/TEST.DATASET.

ROOT is the folder of a saved DatasetDict (ROOT/dataset_dict.json, ROOT/SPLIT/state.json); the
split's first ``Image`` column is the image, its first ``ClassLabel`` column the target (class
names from the label feature). The images are read as stored (``Image(decode=False)``: encoded
bytes, or a file path) and decoded by distribuuuu's decoders, so DATA.DECODER, DATA.BAD_IMAGE,
the seeded transforms and the samplers work as for an ImageFolder. Needs ``pip install datasets``.
"""

from __future__ import annotations

import os

from distribuuuu.data.encoded import EncodedSamples
from distribuuuu.data.errors import BadImageError, DataError
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS
from distribuuuu.data.index import Labels, Samples, Strings

_MAGIC = ((b"\xff\xd8", "jpg"), (b"\x89PNG", "png"), (b"RIFF", "webp"), (b"GIF8", "gif"), (b"BM", "bmp"))


def is_saved_hf(root: str, split: str) -> bool:
    return os.path.isfile(os.path.join(root, split, "state.json")) and os.path.isfile(
        os.path.join(root, split, "dataset_info.json")
    )


class HFImageDataset(EncodedSamples):
    def __init__(self, root: str, split: str, decoder: str = "auto", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        import datasets

        folder = os.path.join(root, split)
        ds = datasets.load_from_disk(folder)
        image = next((k for k, f in ds.features.items() if isinstance(f, datasets.Image)), None)
        label = next((k for k, f in ds.features.items() if isinstance(f, datasets.ClassLabel)), None)
        if image is None or label is None:
            raise DataError(f"{folder}: needs an Image and a ClassLabel column (features: {dict(ds.features)})")
        self.folder, self.image = folder, image
        self.data = ds.cast_column(image, datasets.Image(decode=False))
        labels = Labels.of([int(t) for t in ds[label]])
        names = Strings.of(f"{split}[{i}]" for i in range(len(labels)))
        super().__init__(Samples(names, labels), list(ds.features[label].names), decoder, max_pixels)

    def read_row(self, row: int, name: str) -> tuple[bytes, str]:
        record = self.data[row][self.image]
        try:
            data = record["bytes"]
            if data is None:
                with open(record["path"], "rb") as f:
                    data = f.read()
        except (OSError, TypeError) as e:
            raise BadImageError(f"unreadable image {self.folder} row {row}: {e}") from None
        ext = next((e for magic, e in _MAGIC if data.startswith(magic)), "img")
        return data, f"{self.folder} row {row}.{ext}"
