"""Classify images with a checkpoint: ``python tools/predict.py --weights CKPT [--topk 3] PATH [PATH ...]``.

Each PATH is an image file, a folder (searched recursively for image files), or a dataset root in
another form TEST.DATASET takes (packed shards on disk or over HTTP, a saved Hugging Face
dataset; its ``--split`` is read, each line named by the sample's name); WEIGHTS is a
checkpoint file or a sharded checkpoint folder (``best.dcp``). The model is rebuilt from the
checkpoint's own model and evaluation keys (MODEL_KEYS; ``--cfg FILE`` and trailing ``KEY VALUE``
pairs override them), images get the preprocessing the run validated with (stored in the
checkpoint), and one line per image gives the top-k class names with probabilities (``--json``:
one JSON object per line). A multi-label model's (MODEL.TASK multilabel) probabilities are its
sigmoid scores: its line marks with ``*`` the classes of the top-k that reach the run's
TEST.THRESHOLD (the classes it predicts) and counts those beyond the top-k; its JSON also has every
class's score by name (``scores``), the threshold, and the classes that reach it (``labels``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torchvision.datasets.folder import IMG_EXTENSIONS  # noqa: E402
from yacs.config import CfgNode  # noqa: E402

from distribuuuu.checkpointing.checkpoint import CheckpointError, load_checkpoint, model_state_from  # noqa: E402
from distribuuuu.config import ConfigError  # noqa: E402
from distribuuuu.data import BadImageError, DataError, load_image  # noqa: E402
from distribuuuu.data.annotations import AnnotationSpec  # noqa: E402
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS  # noqa: E402
from distribuuuu.data.readers import Source, build_base_dataset, reader_for  # noqa: E402
from distribuuuu.data.transforms import EvalPreprocessing, build_eval_transform  # noqa: E402
from distribuuuu.errors import tool_error  # noqa: E402
from distribuuuu.training.parallelize import build_configured_model  # noqa: E402
from distribuuuu.training.preprocessing import checkpoint_preprocessing, eval_preprocessing  # noqa: E402
from distribuuuu.training.resume import check_weights_fit, load_full_weights  # noqa: E402
from distribuuuu.training.stored_config import MODEL_KEYS, cfg_from_checkpoint, fit_hint, stored_cfg  # noqa: E402
from distribuuuu.training.task import Task, build_task  # noqa: E402

PROG = os.path.basename(__file__)  # what argparse calls this tool in its errors


class PredictError(ValueError):
    """Bad input to predict.py: the message is printed as one line and the tool exits with 2."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, help="checkpoint (file or .dcp folder) written by train_net.py")
    parser.add_argument("--topk", type=int, default=3, help="classes to print per image (default 3)")
    parser.add_argument("--ema", action="store_true", help="use the checkpoint's EMA weights")
    parser.add_argument("--json", action="store_true", help="print one JSON object per image")
    parser.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default 64)")
    parser.add_argument("--device", default="", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--cfg", dest="cfg_file", default=None, help="YAML whose keys override the checkpoint's")
    parser.add_argument("--split", default="val", help="the split of a dataset root PATH to classify (default val)")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="image files or folders, then KEY VALUE pairs")
    args = parser.parse_intermixed_args(argv)
    # Split "PATH ... KEY VALUE ..." at the first upper-case dotted config key (e.g. TEST.IM_SIZE).
    first_key = next((i for i, a in enumerate(args.paths) if _is_cfg_key(a)), len(args.paths))
    args.paths, args.opts = args.paths[:first_key], args.paths[first_key:]
    if not args.paths:
        parser.error("give at least one image file or folder")
    return args


def _is_cfg_key(arg: str) -> bool:
    return "." in arg and arg.split(".", 1)[0].isupper() and not os.path.exists(arg)


def find_images(paths: Sequence[str]) -> list[str]:
    """Image files named directly, plus those found recursively in folders (sorted per folder)."""
    images: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()  # a stable, readable order: folder by folder
                images += [os.path.join(root, f) for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)]
        elif os.path.isfile(path):
            images.append(path)
        else:
            raise PredictError(f"no such file or folder: {path}")
    if not images:
        raise PredictError(f"no images ({', '.join(IMG_EXTENSIONS)}) found in {', '.join(paths)}")
    return images


class Sample(NamedTuple):
    """One image to classify: the name its output line carries, and how to decode it."""

    name: str
    load: Callable[[], Any]


def find_samples(
    paths: Sequence[str], split: str = "val", decoder: str = "auto", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> list[Sample]:
    """The images of ``paths``: files and folders (``find_images``), and every sample of ``split``
    of a dataset root in TEST.DATASET's other forms, read as training reads it (build_base_dataset)."""
    samples: list[Sample] = []
    for path in paths:
        if reader_for(Source(path, split)).opaque:  # samples only its reader reaches: read the split
            samples += dataset_samples(path, split, decoder, max_pixels=max_pixels)
        else:
            samples += [Sample(p, partial(load_image, p, decoder, max_pixels)) for p in find_images([path])]
    return samples


def dataset_samples(
    root: str,
    split: str,
    decoder: str = "auto",
    annotations: AnnotationSpec | None = None,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> list[Sample]:
    """Every sample of ``split`` of a dataset root in any of TEST.DATASET's forms (or the images
    ``annotations`` lists under it), in its order."""
    dataset, _ = build_base_dataset(root, split, decoder, annotations=annotations, max_pixels=max_pixels)
    names = [name for name, _ in dataset.samples] if hasattr(dataset, "samples") else None
    return [Sample(names[i] if names else f"{root}[{i}]", partial(_image, dataset, i)) for i in range(len(dataset))]


def _image(dataset, index: int):
    return dataset[index][0]


def load_state(path: str) -> dict:
    """Load a checkpoint safely (weights_only) and check it names its classes."""
    state = load_checkpoint(path)
    if not state.get("classes"):
        raise PredictError(
            f"checkpoint {path} holds no class names ('classes'): it was not written by train_net.py; "
            "predict.py needs them to name its predictions"
        )
    return state


def build_cfg(state: dict, cfg_file: str | None, opts: Sequence[str]) -> CfgNode:
    """Defaults < the checkpoint's model/input keys (MODEL_KEYS) < ``--cfg FILE`` < ``KEY VALUE`` pairs."""
    cfg = cfg_from_checkpoint(state, cfg_file, opts, MODEL_KEYS)
    cfg.defrost()
    cfg.MODEL.PRETRAINED = False  # the checkpoint provides every weight: never fetch pretrained ones
    cfg.freeze()
    classes = len(state["classes"])
    if cfg.MODEL.NUM_CLASSES != classes:
        raise ConfigError(f"MODEL.NUM_CLASSES is {cfg.MODEL.NUM_CLASSES} but the checkpoint names {classes} classes")
    return cfg


def resolve_preprocessing(state: dict, cfg_file: str | None, opts: Sequence[str]) -> EvalPreprocessing:
    """The checkpoint's stored preprocessing, unless ``--cfg`` / ``KEY VALUE`` pairs change what the
    evaluation keys resolve to (then theirs, resolved as validation would)."""
    stored = checkpoint_preprocessing(state)
    if not cfg_file and not opts:
        return stored
    saved, asked = (_resolvable(build_cfg(state, f, o), state) for f, o in ((None, ()), (cfg_file, opts)))
    return stored if eval_preprocessing(asked) == eval_preprocessing(saved) else eval_preprocessing(asked)


def _resolvable(cfg: CfgNode, state: dict) -> CfgNode:
    """``cfg`` with the checkpoint's MODEL.PRETRAINED: a pretrained timm model's own preprocessing
    counts (build_cfg turns it off so that no weights are fetched)."""
    saved = stored_cfg(state)
    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.PRETRAINED = saved.get("MODEL", {}).get("PRETRAINED", False)
    return cfg


def load_model(state: dict, cfg: CfgNode, kind: str, device: torch.device, path: str = "the checkpoint") -> nn.Module:
    """Build MODEL.ARCH and load the checkpoint's raw or EMA weights into it, in eval mode."""
    if kind == "ema" and not state.get("ema"):
        raise PredictError("--ema: the checkpoint holds no EMA weights (train with OPTIM.EMA_DECAY > 0)")
    model, weights = build_configured_model(cfg.MODEL), model_state_from(state, kind)
    # test_net's and MODEL.WEIGHTS's check and load: one line naming what does not fit
    check_weights_fit(model.state_dict(), weights, path, state.get("arch"), cfg.MODEL.ARCH, fit_hint(state, cfg))
    load_full_weights(model, weights)
    return model.to(device).eval()


def batches(items: list, size: int) -> Iterator[list]:
    """Consecutive slices of ``items`` of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.no_grad()
def predict(
    model: nn.Module, samples: list[Sample], transform: Callable, device: torch.device, batch_size: int, task: Task
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, every class's probability) per sample, batch by batch: the task's reading of the
    head (a softmax, or a sigmoid per class)."""
    for batch in batches(samples, batch_size):
        inputs = torch.stack([transform(sample.load()) for sample in batch]).to(device)
        yield from zip([sample.name for sample in batch], task.scores(model(inputs)).cpu())


def format_line(path: str, scores: torch.Tensor, task: Task, classes: Sequence[str], k: int, as_json: bool) -> str:
    """One output line of a sample's ``scores``: its ``k`` best classes, ``path: name (p), ...``, those
    the threshold predicts marked ``*``; or a JSON object (``topk``, and with a threshold every
    class's score, the threshold and the classes it predicts)."""
    [(top, probs)] = task.chosen(scores[None], k)
    chosen = task.predicted(scores)
    if as_json:
        record: dict[str, Any] = {"path": path, "topk": [_named(classes[i], p) for i, p in zip(top, probs)]}
        if chosen is not None:
            labels = [i for i in scores.argsort(descending=True).tolist() if chosen[i]]
            record |= {
                "labels": [_named(classes[i], scores[i].item()) for i in labels],
                "scores": {name: round(p, 6) for name, p in zip(classes, scores.tolist())},
                "threshold": task.threshold,
            }
        return json.dumps(record)
    marked = [chosen is not None and bool(chosen[i]) for i in top]
    line = f"{path}: " + ", ".join(f"{classes[i]} ({p:.3f}){'*' * m}" for i, p, m in zip(top, probs, marked))
    beyond = int(chosen.sum()) - sum(marked) if chosen is not None else 0
    return line + (f" (+{beyond} more at or above {task.threshold:g})" if beyond else "")


def _named(name: str, prob: float) -> dict[str, Any]:
    return {"class": name, "prob": round(prob, 6)}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, load, classify, print; known errors become one line on stderr and exit code 2."""
    args = parse_args(argv)
    try:
        if args.topk < 1 or args.batch_size < 1:
            raise PredictError("--topk and --batch-size must be >= 1")
        state = load_state(args.weights)
        cfg = build_cfg(state, args.cfg_file, args.opts)
        images = find_samples(args.paths, args.split, cfg.DATA.DECODER, cfg.DATA.MAX_IMAGE_PIXELS)
        transform = build_eval_transform(resolve_preprocessing(state, args.cfg_file, args.opts), cfg.DATA.DECODER)
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = load_model(state, cfg, "ema" if args.ema else "model", device, args.weights)
        task, k = build_task(cfg.MODEL, cfg.TEST), min(args.topk, cfg.MODEL.NUM_CLASSES)
        for path, scores in predict(model, images, transform, device, args.batch_size, task):
            print(format_line(path, scores, task, state["classes"], k, args.json), flush=True)
    except (PredictError, CheckpointError, ConfigError, DataError, BadImageError) as e:
        return tool_error(PROG, e)
    except BrokenPipeError:  # the reader stopped reading (`| head`): it has the lines it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flush writes nowhere
    return 0


if __name__ == "__main__":
    sys.exit(main())
