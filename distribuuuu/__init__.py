"""distribuuuu: distributed (DDP) image-classification training in pure PyTorch."""

__version__ = "0.1.0"
