"""``RunLock`` leaves no ``.kvpop.lock`` behind a finished run and stays exclusive while it removes it."""
from __future__ import annotations

import os

import pytest

from kvpop.training.runstate import RunDirectoryError, RunLock


def test_a_released_lock_leaves_no_file(tmp_path):
    out = tmp_path / "run"
    with RunLock(out):
        assert (out / RunLock.NAME).exists()
    assert not (out / RunLock.NAME).exists()
    assert list(out.iterdir()) == []


def test_the_lock_is_exclusive_and_free_again_after_release(tmp_path):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(RunDirectoryError, match="in use by another kvpop run"):
        RunLock(tmp_path).acquire()
    first.release()
    RunLock(tmp_path).acquire().release()
    assert not (tmp_path / RunLock.NAME).exists()


def test_a_run_that_opened_the_file_before_it_was_removed_takes_the_new_one(tmp_path, monkeypatch):
    """The race a removing release opens: B opens the file, A removes it and unlocks, B locks the removed
    inode.  B must notice and lock the directory's file instead, so a third run C is refused."""
    first = RunLock(tmp_path).acquire()
    real_open = os.open
    opened = []

    def open_then_release(path, *a, **kw):
        fd = real_open(path, *a, **kw)
        if not opened:  # B has its descriptor; now A finishes (removes the file and unlocks)
            opened.append(fd)
            first.release()
        return fd

    monkeypatch.setattr(os, "open", open_then_release)
    second = RunLock(tmp_path).acquire()
    monkeypatch.setattr(os, "open", real_open)
    assert (tmp_path / RunLock.NAME).exists()
    assert os.fstat(second._fd).st_ino == os.stat(tmp_path / RunLock.NAME).st_ino
    with pytest.raises(RunDirectoryError):
        RunLock(tmp_path).acquire()
    second.release()
