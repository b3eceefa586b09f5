"""The batched decoder's worst cases, the loader alone (no model): a folder of 12 MP photos
(4000x3000 and 3000x4000 mixed) and a folder of ImageNet-sized photos with one CMYK JPEG in every
batch's worth of files (shuffled: about one a batch). Per case: img/s over ``--batches`` batches after one, the peak device memory, how many
images nvJPEG decoded and how many the CPU did (decode_stats; a CMYK file is decoded in a worker,
so it counts in neither).

    python -m benchmarks.worst_cases --work DIR --batch 256 --batches 4 --workers 8 [KEY VALUE ...]
"""

from __future__ import annotations

import os
import sys

from benchmarks.common import emit, environment, guarded, parser, peak_gib, reset_peak, synchronize, timed
from benchmarks.photos import make_photos
from distribuuuu.config import load_cfg
from distribuuuu.data.device_decode import decode_stats
from distribuuuu.training.inputs import build_train_split

CASES = {  # name: (photo size, unique photos, one CMYK file in every batch's worth of files)
    "12mp": ((3000, 4000), 16, False),
    "cmyk_every_batch": ((375, 500), 256, True),
}


def measure(root: str, name: str, opts: list[str], batch: int, batches: int, env) -> dict:
    """The loader of ``root``'s train split through DATA.DECODER batched, ``batches`` batches timed."""
    cfg = load_cfg(None, ["TRAIN.DATASET", root, "TEST.DATASET", root, "DATA.DECODER", "batched",
                          "TRAIN.BATCH_SIZE", str(batch), "MODEL.NUM_CLASSES", "2", "TRAIN.TOPK", "1", *opts])  # fmt: skip
    split = build_train_split(cfg, env)
    split.sampler.set_epoch(0)
    loader = iter(split.loader)
    next(loader)  # the workers start, nvJPEG initialises
    synchronize(env.device)
    reset_peak(env.device)
    decode_stats.reset()
    with timed(env.device) as seconds:
        images = sum(len(next(loader)[0]) for _ in range(batches))
    return {
        "what": "worst_case", "case": name, "batch": batch, "batches": batches, "img_per_s": round(images / seconds(), 1),
        "peak_gib": round(peak_gib(env.device), 2), "device_decoded": decode_stats.gpu_images,
        "cpu_fallback": decode_stats.cpu_fallback_images, "device": str(env.device),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__)
    args.add_argument("--work", required=True, help="folder for the photo folders")
    args.add_argument("--batch", type=int, default=256)
    args.add_argument("--batches", type=int, default=4)
    args.add_argument("--cases", default=",".join(CASES))
    args.add_argument("--scale", type=float, default=1.0, help="shrink the photos' sides (a CPU dry run: 0.05)")
    parsed = args.parse_args(argv)
    env = environment()
    files = parsed.batch * (parsed.batches + 3)  # the timed batches, the first, and what the workers fetch ahead
    for name in parsed.cases.split(","):
        size, unique, cmyk = CASES[name]
        size = tuple(max(int(side * parsed.scale), 8) for side in size)
        root = os.path.join(parsed.work, name)
        if not os.path.isdir(root):
            make_photos(root, unique, size, copies=-(-files // unique), cmyk_every=parsed.batch if cmyk else 0)
        emit(measure(root, name, parsed.opts, parsed.batch, parsed.batches, env), parsed.json)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
