"""Annotation files fuzzed: whatever bytes the file holds, with any header and label-separator
option, reading it gives a dataset whose every sample is a listed image with a valid target, or
one DataError of one line; never another exception, and each file within a deadline. A file of
megabytes on one line is refused as fast."""

from __future__ import annotations

import csv
import io
import os
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from distribuuuu.data import DataError
from distribuuuu.data.annotations import AnnotationSpec, read_annotations

# The examples a run tries, and how long one may take: ~2 s for the whole test on a 2-vCPU EPYC.
# database=None: nothing written into the working tree (.hypothesis/); derandomize: every run of
# the suite tries the same examples, so a failure is the same failure on every machine.
FUZZ = settings(
    max_examples=200,
    deadline=500,  # ms per example: a file of at most ~2 KB parses in well under 1 ms
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
IMAGES = ["a.png", "b c.png", "sub/d.jpg", "e,f.png", 'g"h.png', "\u00e9t\u00e9.png"]
SUFFIXES = [".csv", ".tsv", ".txt", ".lst", ""]

# Pieces of lines that reach each branch of the reader: real image paths, absolute and missing
# ones, labels, every separator, quotes, a byte-order mark, line breaks of every kind, NUL, and
# bytes that are not UTF-8.
_PIECES = st.sampled_from(
    [
        *(p.encode() for p in IMAGES),
        b"missing.png",
        b"/",
        b"..",
        b"cat",
        b"dog",
        b"0",
        b"1 2",
        b",",
        b"\t",
        b" ",
        b";",
        b"|",
        b'"',
        b"\n",
        b"\r\n",
        b"\r",
        b"\x0b\x0c\x1c\x85",
        b"\xef\xbb\xbf",
        b"\x00",
        b"\xff\xfe",
        b"\xe9",
    ]
)
# Fields of any characters, a listed image's path among them, written as the csv module writes
# them (quoted where they hold a separator, a quote or a line break) or joined by whitespace.
_CHARS = st.one_of(st.sampled_from(list(',\t ;|"\n\r\x00\x0b\x85\u2028\ufeff\u00e9ab.')), st.characters(codec="utf-8"))
_TEXT = st.text(_CHARS, max_size=6)
_PATH = st.one_of(st.sampled_from(IMAGES), st.sampled_from(IMAGES), _TEXT)  # mostly an image that is there
_LABEL = st.one_of(st.sampled_from(["cat", "dog", "0", "1 2", "a;b", "x|y", ""]), _TEXT)
_PAIR = st.tuples(_PATH, _LABEL).map(list)
_ROW = st.one_of(_PAIR, _PAIR, _PAIR, st.lists(_TEXT, max_size=4))  # mostly a path and a label


def _written(rows: list[list[str]], delimiter: str, bom: bool) -> bytes:
    buf = io.StringIO()
    if delimiter == " ":
        buf.write("".join(" ".join(row) + "\n" for row in rows))
    else:
        csv.writer(buf, delimiter=delimiter).writerows(rows)
    return ("\ufeff" if bom else "").encode() + buf.getvalue().encode()


@st.composite
def annotation_files(draw) -> tuple[str, bytes]:
    """A file's suffix and bytes: rows written in the suffix's own format, pieces, or any bytes."""
    suffix = draw(st.sampled_from(SUFFIXES))
    delimiter = {".csv": ",", ".tsv": "\t"}.get(suffix, " ")
    rows = st.builds(_written, st.lists(_ROW, min_size=1, max_size=8), st.just(delimiter), st.booleans())
    content = st.one_of(
        rows,
        rows,
        rows,
        st.lists(st.one_of(_PIECES, st.binary(max_size=8)), max_size=60).map(b"".join),
        st.binary(max_size=256),
    )
    return suffix, draw(content)


LABEL_SEPS = st.one_of(st.sampled_from(["", " ", ";", "|", ",", "\t", "\n", ";;"]), st.text(min_size=1, max_size=2))


@pytest.fixture(scope="module")
def root() -> Path:
    """A dataset root holding the images IMAGES names (empty files: nothing here decodes them)."""
    with tempfile.TemporaryDirectory() as folder:
        for name in IMAGES:
            (Path(folder) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(folder) / name).touch()
        yield Path(folder)


@FUZZ
@given(file=annotation_files(), header=st.booleans(), label_sep=LABEL_SEPS)
# Known hazards, tried on every run: a quoted line break in a missing path (its message would span
# two lines), a byte-order mark, NUL, a space in a path, and a third field.
@example(file=(".csv", b'a.png,cat\r\n"miss\ning.png",dog\r\n'), header=False, label_sep="")
@example(file=(".txt", b"\xef\xbb\xbfa.png cat\n"), header=False, label_sep="")
@example(file=(".csv", b"a.png,c\x00t\n"), header=False, label_sep="")
@example(file=(".txt", b"a.png cat\nb c.png dog\n"), header=False, label_sep="")
@example(file=(".lst", b"a.png 0 extra\n"), header=True, label_sep=";")
def test_any_annotation_file_gives_a_dataset_or_one_line_data_error(root, file, header, label_sep):
    suffix, content = file
    with tempfile.NamedTemporaryFile(dir=root, suffix=suffix, delete=False) as f:
        f.write(content)
    try:
        samples, classes = read_annotations(str(root), AnnotationSpec(os.path.basename(f.name), header, "", label_sep))
    except DataError as e:
        message = str(e)
        assert message and "\n" not in message and "\r" not in message, repr(message)
        return
    finally:
        os.unlink(f.name)
    assert samples and classes and len(set(classes)) == len(classes)
    for path, target in samples:
        assert os.path.relpath(path, root) in IMAGES  # a listed image, found where it is
        indices = target if label_sep else (target,)
        assert isinstance(target, tuple if label_sep else int)
        assert list(indices) == sorted(set(indices)) and all(0 <= i < len(classes) for i in indices)


@pytest.mark.parametrize("suffix", [".csv", ".txt"])
def test_a_file_of_megabytes_on_one_line_is_refused_in_bounded_time(root, tmp_path, suffix):
    # csv refuses a field over its limit (128 KB); a whitespace line is split once: neither grows
    # beyond the file, and neither takes long.
    (tmp_path / f"big{suffix}").write_bytes(b"a.png," + b"x" * 8_000_000 + b" y z")
    started = time.perf_counter()
    with pytest.raises(DataError) as refused:
        read_annotations(str(root), AnnotationSpec(str(tmp_path / f"big{suffix}")))
    assert time.perf_counter() - started < 2.0
    assert len(str(refused.value).splitlines()) == 1 and len(str(refused.value)) < 1000
