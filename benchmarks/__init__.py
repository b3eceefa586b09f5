"""Measurements for a machine with a GPU (they run on a CPU too, shrunk, as a dry run): each module
is one measurement, run as ``python -m benchmarks.NAME ...`` from the repository root, printing one
JSON line per result (and appending it to ``--json FILE``). docs/scripts/gpu_session.sh runs them;
docs/gpu.md has what they measured and the commands.

- ``ceiling``: the model's own ceiling, a batch resident on the device, timed by CUDA events.
- ``epochs``: DATA.DECODER batched over whole epochs of train_net.py: its log's windows, and
  memory_reserved after each pass of each loader.
- ``resample``: the batched resample alone, whole and chunked, and its products in fp32, TF32, bf16, fp16.
- ``worst_cases``: the loader alone on 12 MP photos and on batches with one CMYK JPEG each.
- ``trace``: a profiler trace of 20 steady training steps.
- ``photos``: the synthetic photo folders they read.

And one for any machine, too large for tools/benchmark.py itself, which calls it:

- ``index``: the dataset index at ImageNet size (``tools/benchmark.py --what index``): the listing,
  the index in the rank, each DataLoader worker's growth over an epoch, N local ranks' start-up.

And a script for any machine, run as ``python benchmarks/activation_checkpointing.py``: what
MODEL.ACTIVATION_CHECKPOINTING keeps for backward and costs (docs/performance.md).
"""
