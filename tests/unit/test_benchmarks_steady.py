"""The steady-state measurements' own logic (benchmarks/, run by docs/scripts/gpu_session.sh's steady
stage): what they read from train_net.py's log, and the photo folders they measure. Their numbers
are measured, never asserted; the stage's dry run (GPU_SESSION_DRY=1) runs them on a CPU."""

from __future__ import annotations

import os

from PIL import Image

from benchmarks.epochs import read_log, summary
from benchmarks.photos import make_photos

LOG = """\
[11/28 16:17:36 distribuuuu.trainer] epoch 1/2  step 10/16  loss 4.0621  top1 41.25  top5 80.00  lr 0.024771  2 img/s  data 0.045s/step  eta 0:01:20
[11/28 16:18:17 distribuuuu.trainer] epoch 1/2  step 16/16  loss 5.3630  top1 50.00  top5 100.00  lr 0.025906  1 img/s  data 0.007s/step  eta 0:01:48
[11/28 16:18:18 distribuuuu.bench] loader pass 1: 16 batches, memory_reserved 1024.0 MiB
[11/28 16:18:18 distribuuuu.bench] loader pass 2: 1 batches, memory_reserved 1030.5 MiB
[11/28 16:18:18 distribuuuu.trainer] val model epoch 1: loss 6208.0000  top1 50.00  top5 100.00  (8 images, 9 img/s)
[11/28 16:18:38 distribuuuu.trainer] epoch 2/2  step 10/16  loss 4.7523  top1 66.25  top5 100.00  lr 0.0056747  4 img/s  data 0.013s/step  eta 0:00:12
[11/28 16:18:45 distribuuuu.trainer] epoch 2/2  step 16/16  loss 4.4905  top1 52.08  top5 100.00  lr 0.00012038  7 img/s  data 0.011s/step  eta 0:00:00
"""


def test_the_epochs_summary_reads_each_window_and_pass_and_sets_the_first_window_apart(tmp_path):
    (tmp_path / "log.txt").write_text(LOG)
    windows, passes = read_log(str(tmp_path / "log.txt"))
    assert [(w["epoch"], w["step"], w["img_per_s"], w["data_s"]) for w in windows] == [
        (1, 10, 2.0, 0.045), (1, 16, 1.0, 0.007), (2, 10, 4.0, 0.013), (2, 16, 7.0, 0.011),
    ]  # fmt: skip
    first, epoch_1, epoch_2, loader_passes = summary(windows, passes)
    assert first["what"] == "first_window" and first["step"] == 10  # compiling, workers starting: apart
    assert epoch_1["img_per_s"] == [1.0] and epoch_2["img_per_s_median"] == 5.5
    assert epoch_2["data_s_per_step"] == 0.012
    assert loader_passes == {"what": "passes", "reserved_mib": [1024.0, 1030.5], "batches": [16, 1]}


def test_the_photo_folders_link_their_photos_and_hold_one_cmyk_jpeg_a_batch(tmp_path):
    written = make_photos(str(tmp_path), photos=4, size=(30, 40), copies=8, cmyk_every=8)
    train = [os.path.join(d, f) for d, _, names in os.walk(tmp_path / "train") for f in names]
    assert written == len(train) == 32
    modes = [Image.open(p).mode for p in train]
    assert modes.count("CMYK") == 32 // 8 and modes.count("RGB") == 32 - 4
    sizes = {Image.open(p).size for p in train}
    assert sizes == {(40, 30), (30, 40)}  # both orientations
    assert os.path.isdir(tmp_path / "val")
