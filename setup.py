"""Packaging for distribuuuu; runtime requirements are read from requirements.txt."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
REQUIREMENTS = [
    line.strip()
    for line in (HERE / "requirements.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

# torch.onnx's dynamo exporter needs onnxscript; onnxruntime checks the exported model.
EXPORT = ["onnx", "onnxruntime", "onnxscript"]
RUFF = "ruff==0.17.6"
# Packed datasets: webdataset writes the shards, wids (webdataset's indexed reader) reads them.
DATA = ["webdataset>=1.0", "wids>=0.1.11"]
# Packed datasets in object stores (s3://, gs://, az://): obstore, chosen by measurement (docs/design.md).
CLOUD = ["obstore>=0.12"]

# The export, tracker, timm, packed-data and object-store tests need those extras: "test" installs
# them so that they run (CI installs it). ruff is pinned: CI checks the formatting, and another ruff
# version formats differently.
TEST = [
    "pytest>=7.3",  # tmp_path_retention_policy (pyproject.toml)
    "matplotlib",
    "timm",
    *EXPORT,
    "wandb",
    "mlflow-skinny",
    *DATA,
    *CLOUD,
    "moto[server]",  # a local S3-compatible server for the object-store tests
    "datasets",
    "torchcodec",
    "scikit-learn",  # the reference the multi-label metrics are checked against
    "hypothesis",  # the annotation-file and config readers fuzzed (test_annotation_fuzz.py, test_config_errors.py)
    RUFF,
]

setup(
    name="distribuuuu",
    version="0.1.0",
    description="Distributed (DDP or FSDP2) image-classification training in pure PyTorch",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["distribuuuu", "distribuuuu.*"]),
    python_requires=">=3.9",
    install_requires=REQUIREMENTS,
    extras_require={
        "test": TEST,
        "plot": ["matplotlib"],
        "timm": ["timm"],
        "export": EXPORT,
        "data": DATA,
        "cloud": CLOUD,
        "hf": ["datasets"],  # TRAIN/TEST.DATASET: an image dataset saved with datasets' save_to_disk
        # JPEG decoding by TorchCodec, the successor of torchvision's deprecated decoders (images need no FFmpeg)
        "codec": ["torchcodec"],
        "wandb": ["wandb"],
        "mlflow": ["mlflow-skinny"],  # the tracking client; the full "mlflow" adds the server and UI
        "dev": TEST,  # a contributor runs the suite CI runs: no test skips for a missing extra
    },
    license="MIT",
)
