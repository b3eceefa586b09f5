"""Export a checkpoint to ONNX and to a torch.export program, and check both against PyTorch.

    python tools/export.py --weights OUT_DIR/best.pth.tar [--ema] [--out PREFIX] [--check PATH ...] [--split val]
    python tools/export.py --weights OUT_DIR/best.dcp ...     # a sharded checkpoint (fsdp/hsdp runs)

Writes PREFIX.onnx (dynamic batch dimension; input "images" NCHW float32, output "logits"),
PREFIX.pt2 (``torch.export.save``; load with ``torch.export.load(path).module()``) and
PREFIX.json: the preprocessing the run validated with (resize, crop, interpolation, mean/std, RGB
in [0, 1]; stored in the checkpoint) and the class names, also stored in the ONNX file's
metadata_props and in the .pt2's extra files. Then runs PyTorch, onnxruntime and the loaded
program on real images (--check: files, folders or dataset roots as predict.py takes them; by
default the checkpoint's own TEST.DATASET at TEST.SPLIT, in any of its forms) and prints, per format, the
top-1 agreement and the largest logit difference.

Needs the "export" extra (onnx, onnxruntime, onnxscript). Exit status: 0; 1 when an export
disagrees with PyTorch on some top-1; 2 on bad input (missing checkpoint, an architecture that
cannot be exported, a missing package), printed as one line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # predict.py beside it, however this file is run

import torch  # noqa: E402
from predict import (  # noqa: E402
    PredictError,
    Sample,
    batches,
    build_cfg,
    dataset_samples,
    find_samples,
    load_model,
    load_state,
)
from torch import nn  # noqa: E402
from yacs.config import CfgNode  # noqa: E402

from distribuuuu.checkpointing.checkpoint import CheckpointError  # noqa: E402
from distribuuuu.config import ConfigError, stored_config  # noqa: E402
from distribuuuu.data import BadImageError, DataError  # noqa: E402
from distribuuuu.data.transforms import EvalPreprocessing, build_eval_transform  # noqa: E402
from distribuuuu.errors import EXIT_FAILED, first_line, tool_error  # noqa: E402
from distribuuuu.training.inputs import annotation_spec  # noqa: E402
from distribuuuu.training.preprocessing import checkpoint_preprocessing  # noqa: E402
from distribuuuu.training.task import build_task  # noqa: E402

PROG = os.path.basename(__file__)  # what argparse calls this tool in its errors

EXIT_DISAGREE = EXIT_FAILED  # the exported model disagrees with the checkpoint
INPUT, OUTPUT = "images", "logits"


class ExportError(ValueError):
    """An export that cannot be made: printed as one line, exit 2."""


def preprocessing(p: EvalPreprocessing, arch: str, classes: list, weights: str) -> dict:
    """What a deployment must do to an image before the model (the run's validation), and the class names."""
    return {
        "arch": arch,
        "weights": weights,
        "input": {"name": INPUT, "layout": "NCHW", "dtype": "float32", "channels": "RGB"},
        "output": {"name": OUTPUT, "meaning": "logits (softmax for probabilities)"},
        "resize": p.resize,  # the shorter side, as torchvision's Resize(int)
        "crop": p.crop,  # center crop, square
        "interpolation": p.interpolation,
        "antialias": True,
        "scale": "divide 8-bit pixel values by 255",
        "mean": list(p.mean),
        "std": list(p.std),
        "classes": list(classes),
    }


def task_of(cfg) -> dict:
    """The task the logits serve: one class (softmax) or, multi-label, each class whose sigmoid
    score reaches the run's threshold."""
    meaning = build_task(cfg.MODEL, cfg.TEST).head_meaning()
    if "output" in meaning:
        meaning["output"] = {"name": OUTPUT, "meaning": meaning["output"]}
    return meaning


def export_onnx(program: torch.export.ExportedProgram, path: str, meta: dict) -> None:
    """ONNX from the traced program (torch.onnx's dynamo exporter takes it as it is, so the model
    is traced once for both formats), metadata in metadata_props."""
    import onnx

    torch.onnx.export(
        program, (), path, input_names=[INPUT], output_names=[OUTPUT], dynamo=True, external_data=False, verbose=False
    )
    proto = onnx.load(path)
    name_batch_dimension(proto.graph)
    onnx.helper.set_model_props(proto, {"distribuuuu.preprocessing": json.dumps(meta)})
    onnx.save(proto, path)


def name_batch_dimension(graph) -> None:
    """Name the batch dimension "batch" wherever the exporter gave it its symbol's name (s0, s77)."""
    symbol = graph.input[0].type.tensor_type.shape.dim[0].dim_param
    for value in (*graph.input, *graph.output, *graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if symbol and dim.dim_param == symbol:
                dim.dim_param = "batch"


def export_program(model: nn.Module, example: torch.Tensor, path: str, meta: dict) -> torch.export.ExportedProgram:
    """A torch.export program with a dynamic batch dimension, preprocessing in its extra files."""
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, path, extra_files={"preprocessing.json": json.dumps(meta)})
    return program


@contextlib.contextmanager
def quiet_torch_logs():
    """Keep torch.export's and the ONNX exporter's warnings off stderr: a failed export prints its
    partial graph there (dozens of lines), and the user gets one line from us instead."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith("torch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@torch.no_grad()
def check(runners: dict[str, Callable], images: list[Sample], transform: Callable, batch_size: int) -> dict[str, tuple]:
    """Run every runner on the images; per non-reference runner: (top-1 agreements, images, max |logit diff|)."""
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in runners}
    for batch in batches(images, batch_size):
        inputs = torch.stack([transform(sample.load()) for sample in batch])
        for name, runner in runners.items():
            logits[name].append(runner(inputs).float())
    ref = torch.cat(logits.pop("pytorch"))
    results = {}
    for name, outs in logits.items():
        out = torch.cat(outs)
        agree = int((out.argmax(1) == ref.argmax(1)).sum())
        results[name] = (agree, len(ref), float((out - ref).abs().max()))
    return results


def onnx_runner(path: str) -> Callable[[torch.Tensor], torch.Tensor]:
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run([OUTPUT], {INPUT: x.numpy()})[0])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, help="checkpoint (file or .dcp folder) written by train_net.py")
    parser.add_argument("--ema", action="store_true", help="export the checkpoint's EMA weights")
    parser.add_argument(
        "--out", default="", help="output path prefix (default: the checkpoint's, without .pth.tar/.dcp)"
    )
    parser.add_argument("--check", nargs="*", default=None, help="images/folders to check on (default: val folder)")
    parser.add_argument("--split", default="val", help="the split of a dataset root given to --check (default val)")
    parser.add_argument("--max-check", type=int, default=256, help="check at most N images (0: all)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per checked batch")
    return parser.parse_args(argv)


def export(args: argparse.Namespace) -> int:
    """Load, export both formats, check them; return the exit status."""
    state = load_state(args.weights)  # a file, or a sharded folder read whole (checked: verifies, names classes)
    cfg = build_cfg(state, None, ())
    kind = "ema" if args.ema else "model"
    model = load_model(state, cfg, kind, torch.device("cpu"), args.weights)
    prefix = args.out or args.weights.rstrip("/").removesuffix(".dcp").removesuffix(".tar").removesuffix(".pth")
    p = checkpoint_preprocessing(state)
    meta = preprocessing(p, cfg.MODEL.ARCH, state["classes"], kind) | task_of(cfg)
    example = torch.randn(2, 3, p.crop, p.crop)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    except OSError as e:
        raise ExportError(f"--out: cannot create the folder of {prefix}: {e.strerror or e}") from None
    try:
        with quiet_torch_logs():
            program = export_program(model, example, prefix + ".pt2", meta)
            export_onnx(program, prefix + ".onnx", meta)
    except ImportError as e:
        raise ExportError(f"{e.name or e} is not installed: pip install 'distribuuuu[export]'") from None
    except Exception as e:  # noqa: BLE001 - torch.export/onnx raise many types; the user needs one line
        raise ExportError(f"{cfg.MODEL.ARCH} cannot be exported: {type(e).__name__}: {first_line(e)[:300]}") from None
    with open(prefix + ".json", "w") as f:
        json.dump(meta, f, indent=2)
    print(f"wrote {prefix}.onnx, {prefix}.pt2 and {prefix}.json ({kind} weights of {cfg.MODEL.ARCH})")
    return report(model, prefix, args, checked_samples(args, state, cfg), build_eval_transform(p))


def checked_samples(args: argparse.Namespace, state: dict, cfg: CfgNode) -> list[Sample]:
    """--check's images, else the checkpoint's own val split (TEST.DATASET at TEST.SPLIT, in whichever
    form, or its TEST.ANN_FILE)."""
    if args.check:
        images = find_samples(args.check, args.split, max_pixels=cfg.DATA.MAX_IMAGE_PIXELS)
    else:
        run_cfg = stored_config(state["cfg"], "the checkpoint") if state.get("cfg") else CfgNode()
        saved = run_cfg.get("TEST", {})
        spec = annotation_spec(run_cfg, train=False) if saved.get("ANN_FILE") else None
        root, split = saved.get("DATASET", cfg.TEST.DATASET), saved.get("SPLIT", cfg.TEST.SPLIT)
        images = dataset_samples(root, split, annotations=spec, max_pixels=cfg.DATA.MAX_IMAGE_PIXELS)
    return images[: args.max_check] if args.max_check > 0 else images


def report(model: nn.Module, prefix: str, args: argparse.Namespace, images: list[Sample], transform: Callable) -> int:
    """Check the exports against PyTorch on real images and print one line per format."""
    program = torch.export.load(prefix + ".pt2").module()
    runners = {"pytorch": model, "onnx": onnx_runner(prefix + ".onnx"), "torch.export": program}
    ok = True
    for name, (agree, total, diff) in check(runners, images, transform, args.batch_size).items():
        print(f"{name}: top-1 agrees with PyTorch on {agree}/{total} images; largest logit difference {diff:.3g}")
        ok &= agree == total
    return 0 if ok else EXIT_DISAGREE


def main(argv: Sequence[str] | None = None) -> int:
    """Export; known errors become one line on stderr and exit code 2."""
    args = parse_args(argv)
    try:
        return export(args)
    except (ExportError, PredictError, CheckpointError, ConfigError, DataError, BadImageError) as e:
        return tool_error(PROG, e)


if __name__ == "__main__":
    sys.exit(main())
