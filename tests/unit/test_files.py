"""Atomic writes: a file or folder is replaced whole or not at all, with no temporary left behind."""

import os
import stat
import threading

import pytest

from distribuuuu import files


def test_atomic_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "a.bin"
    files.write_bytes(str(path), b"old")
    with files.atomic_write(str(path)) as f:
        f.write(b"new ")
        assert path.read_bytes() == b"old", "the target changes only at the rename"
        f.write(b"content")
    assert path.read_bytes() == b"new content"
    assert os.listdir(path.parent) == ["a.bin"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "a.txt"
    files.write_bytes(str(path), b"good")
    for error in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with files.atomic_write(str(path), "w") as f:
                f.write("half")
                raise error
        assert path.read_bytes() == b"good"
        assert os.listdir(tmp_path) == ["a.txt"]


def test_the_written_file_has_the_permissions_open_would_give(tmp_path):
    old = os.umask(0o022)
    try:
        files.write_bytes(str(tmp_path / "a"), b"x")
        (tmp_path / "b").write_bytes(b"x")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(tmp_path / "a").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "b").st_mode) == 0o644


def test_concurrent_writers_of_one_path_leave_one_whole_file(tmp_path):
    path = str(tmp_path / "shared")
    payloads = [bytes([i]) * 100_000 for i in range(8)]
    threads = [threading.Thread(target=files.write_bytes, args=(path, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert open(path, "rb").read() in payloads
    assert os.listdir(tmp_path) == ["shared"]


def test_replace_dir_swaps_a_finished_folder_in_and_removes_the_old_one(tmp_path):
    target = tmp_path / "ckpt.dcp"
    for content in ("first", "second"):
        tmp = files.temporary_name(str(target))
        os.makedirs(tmp)
        with open(os.path.join(tmp, "data"), "w") as f:
            f.write(content)
        files.replace_dir(tmp, str(target))
        assert (target / "data").read_text() == content
        assert os.listdir(tmp_path) == ["ckpt.dcp"]
