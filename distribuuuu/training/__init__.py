"""The training run: what one run holds, its checkpointed state, and its evaluation.

- ``run``: ``Run`` and ``TrainState``, built once from the config (``build_run``), the process set up.
- ``components``: the run's state as the Stateful components a checkpoint holds, in either format.
- ``resume``: saving a training checkpoint, finding the one to resume, resuming or loading weights.
- ``evaluation``: ``validate`` (every sample once across ranks) and ``test_model`` (tools/test_net.py).
- ``distillation``: the frozen teacher of knowledge distillation, built from its checkpoint.
- ``optim``: optimizers with parameter groups and the LR schedule as a pure function.
- ``losses``: cross-entropy and binary cross-entropy, class-weighted, and the distillation loss.
- ``rng``: per-rank seeds and RNG state for bit-identical resume.
- ``precise_bn``: BatchNorm statistics recomputed over fixed images, summed exactly across ranks.

It owns the run's state: ``checkpointing`` below it writes and reads checkpoint formats and
never sees a ``Run``. The algorithm itself is ``distribuuuu.trainer``.
"""
