"""A training run's own errors: an unwritable OUT_DIR stops before training with exit 2, and an error
inside the model keeps its traceback."""

from __future__ import annotations

import pytest
import torch
from fault_helpers import DIGITS
from helpers import FAST

from distribuuuu import cli, trainer

pytestmark = pytest.mark.usefixtures("plain_logging")


def test_unwritable_out_dir_fails_before_training_with_exit_2(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = blocker / "out"
    args = ["OUT_DIR", str(out), "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS]
    assert cli.run_tool(trainer.train_model, args) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"distribuuuu: error: OUT_DIR: cannot write to {out}" in err
    assert blocker.read_text() == "not a directory"


def test_an_error_inside_the_model_keeps_its_traceback(tmp_path):
    """Only failed collectives become one-line errors: a model's own bug must surface as raised."""
    from distribuuuu.models import register_model

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (32x48 and 64x10)")

    register_model("broken_forward")(lambda num_classes, pretrained=False: Broken())
    args = ["OUT_DIR", str(tmp_path), *FAST, "MODEL.ARCH", "broken_forward", "TRAIN.DATASET", DIGITS]
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as raised:
        cli.run_tool(trainer.train_model, [*args, "TEST.DATASET", DIGITS])
    assert raised.traceback[-1].name == "forward", "the traceback ends where the model failed"
