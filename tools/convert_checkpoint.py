"""Convert between sharded (DCP directory) and single-file checkpoints.

    python tools/convert_checkpoint.py OUT/checkpoints/ckpt_ep_010.dcp model.pth.tar   # sharded -> file
    python tools/convert_checkpoint.py OUT/checkpoints/ckpt_ep_010.pth.tar ckpt.dcp     # file -> sharded

The direction follows from the input: a directory is sharded, a file is single. The file form is what
test_net.py, predict.py, MODEL.WEIGHTS and fine-tuning read. File -> sharded rebuilds the model and
optimizer from the checkpoint's own config (its optimizer state is numbered by position, and only the
optimizer knows each position's parameter). Runs in one process; exits 2 with one line on a bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from distribuuuu.checkpointing.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from distribuuuu.config import get_cfg_defaults, stored_config  # noqa: E402
from distribuuuu.errors import tool_error  # noqa: E402
from distribuuuu.training.convert import from_single_file, to_single_file  # noqa: E402
from distribuuuu.training.optim import build_optimizer  # noqa: E402
from distribuuuu.training.parallelize import build_configured_model  # noqa: E402

PROG = os.path.basename(__file__)  # what argparse calls this tool in its errors


def file_to_sharded(path: str, out_dir: str) -> None:
    """Rebuild the run's model and optimizer from the file's cfg, load it, and save it sharded."""
    saved = load_checkpoint(path)
    if not saved.get("cfg"):
        raise CheckpointError(f"{path} holds no cfg: cannot rebuild its model and optimizer")
    cfg = get_cfg_defaults()
    cfg.merge_from_other_cfg(stored_config(saved["cfg"], "the checkpoint"))
    cfg.MODEL.PRETRAINED = False  # the file's weights replace any download
    model = build_configured_model(cfg.MODEL)
    optimizer = build_optimizer(model, cfg.OPTIM) if saved.get("optimizer") else None
    with warnings.catch_warnings():  # one process by design: DCP's "assuming ... a single process" is noise here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        from_single_file(path, out_dir, model, optimizer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a sharded checkpoint directory or a single checkpoint file")
    parser.add_argument("target", help="the file or directory to write (must not exist)")
    args = parser.parse_args(argv)
    try:
        if os.path.exists(args.target):
            raise CheckpointError(f"{args.target} exists: refusing to overwrite it")
        if os.path.isdir(args.source):
            to_single_file(args.source, args.target)
        else:
            file_to_sharded(args.source, args.target)
    except (CheckpointError, OSError) as e:
        return tool_error(PROG, e)
    print(f"wrote {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
