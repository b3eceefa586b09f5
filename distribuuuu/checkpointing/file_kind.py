"""What a file handed us as a checkpoint is, when it is plainly none: an image, a document, a config.

``torch.load`` reads anything as a pickle and refuses an image as holding objects that
``weights_only=True`` does not allow, which suggests an unsafe load of what is no checkpoint at all.
torch.save writes a zip archive (``PK\\x03\\x04``), or in its legacy format a pickle (``\\x80``);
a file that starts as a known other format is named as that instead. A file that matches nothing
known (a damaged checkpoint among others) is left to ``torch.load``, whose error names it corrupt.
"""

from __future__ import annotations

import os
import struct

# Leading bytes of formats a user may hand over by mistake, with what to call them.
_SIGNATURES = (
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"II*\x00", "a TIFF image"),
    (b"MM\x00*", "a TIFF image"),
    (b"%PDF", "a PDF document"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"\x7fELF", "an executable (ELF)"),
    (b"\x93NUMPY", "a NumPy array (.npy)"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
)
_TORCH_SAVE_STARTS = (b"PK\x03\x04", b"PK\x05\x06", b"\x80")  # zip (with entries, or empty); legacy pickle
_HEAD = 512


def describe_non_checkpoint(path: str) -> str | None:
    """What ``path`` is when it is plainly no checkpoint ("a JPEG image", "a folder of 3 files without
    DCP's .metadata"), or None: it may be one (or is unreadable), and loading it decides."""
    if os.path.isdir(path):
        return _describe_folder(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return None
    if not head or head.startswith(_TORCH_SAVE_STARTS):
        return None
    return _describe_bytes(head)


def _describe_bytes(head: bytes) -> str | None:
    """The format ``head`` (a file's first bytes, not those of torch.save) starts, if known."""
    for signature, what in _SIGNATURES:
        if head.startswith(signature):
            return what
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "a WebP image"
    if head[:2] == b"BM" and head[6:10] == b"\0\0\0\0":  # its reserved bytes: not a text that starts "BM"
        return "a BMP image"
    if head[257:262] == b"ustar":
        return "a tar archive"
    if len(head) > 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] > 0:
        return "a safetensors file (load it with safetensors.torch.load_file and torch.save its dict)"
    if b"\0" not in head and _is_text(head):
        return "a text file"
    return None


def _is_text(head: bytes) -> bool:
    """UTF-8 text, allowing a character cut at the end of ``head``."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3
    return True


def _describe_folder(path: str) -> str | None:
    """A folder that is no DCP checkpoint (neither DCP's .metadata nor our manifest in it), or None."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    if ".metadata" in names or "manifest.json" in names:
        return None
    return f"a folder of {len(names)} entries without DCP's .metadata"
