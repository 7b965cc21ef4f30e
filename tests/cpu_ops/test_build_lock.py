"""The kernel build's lock: a build killed midway must not make every later load wait.

torch's `FileBaton` is a plain file in the build folder; `load` waits while it exists. A
process killed mid-build leaves it behind (seen on a shared machine: every engine start hung
for 15 minutes). vserve builds under an flock, which the kernel releases when its holder dies,
and clears a baton it finds while holding it. The build folder's key covers the compiler
flags too.
"""

from __future__ import annotations

import fcntl

import pytest
import torch.utils.cpp_extension as cpp_extension
from torch.utils.file_baton import FileBaton

from vserve import cpu_ops


@pytest.fixture
def build_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_ops, "build_dir", lambda sources: tmp_path)
    return tmp_path


def _fake_load(checks):
    def load(name, sources, build_directory, **kwargs):
        baton = FileBaton(f"{build_directory}/{cpu_ops.BATON}")
        if not baton.try_acquire():  # torch would now wait for the file to go, forever
            raise AssertionError("the build would wait for a stale baton")
        try:
            checks(build_directory)
            return "module"
        finally:
            baton.release()

    return load


def test_a_baton_left_by_a_killed_build_is_cleared(build_folder, monkeypatch):
    (build_folder / cpu_ops.BATON).write_text("")  # what a build killed midway leaves
    monkeypatch.setattr(cpp_extension, "load", _fake_load(lambda folder: None))
    assert cpu_ops._compile((cpu_ops.SAMPLE_SOURCE,), "vserve_test") == "module"
    assert not (build_folder / cpu_ops.BATON).exists()


def test_the_build_holds_the_folder_lock(build_folder, monkeypatch):
    def other_process_cannot_build(folder):
        with open(f"{folder}/build.flock", "a") as f:  # a second open file: another holder
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)

    monkeypatch.setattr(cpp_extension, "load", _fake_load(other_process_cannot_build))
    assert cpu_ops._compile((cpu_ops.SAMPLE_SOURCE,), "vserve_test") == "module"
    with open(build_folder / "build.flock", "a") as f:  # released afterwards
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_checkouts_with_the_same_sources_build_from_one_place(build_folder, monkeypatch, tmp_path):
    """ninja records the source paths it compiled: two checkouts of the same sources
    handed it their own paths and rebuilt each other's kernels on every load."""
    seen = []

    def load(name, sources, build_directory, **kwargs):
        seen.append(sources)
        return "module"

    monkeypatch.setattr(cpp_extension, "load", load)
    for checkout in ("a", "b"):
        folder = tmp_path / checkout
        folder.mkdir()
        source = folder / cpu_ops.SAMPLE_SOURCE.name
        source.write_bytes(cpu_ops.SAMPLE_SOURCE.read_bytes())
        (folder / "vec16.h").write_text("// a header\n")
        cpu_ops._compile((source,), "vserve_test")
    assert seen[0] == seen[1] == [str(build_folder / "src" / cpu_ops.SAMPLE_SOURCE.name)]
    assert (build_folder / "src" / "vec16.h").read_text() == "// a header\n"
    stamp = (build_folder / "src" / cpu_ops.SAMPLE_SOURCE.name).stat().st_mtime_ns
    cpu_ops._compile((source,), "vserve_test")  # unchanged: not rewritten (ninja reads mtimes)
    assert (build_folder / "src" / cpu_ops.SAMPLE_SOURCE.name).stat().st_mtime_ns == stamp


def test_the_build_folder_is_keyed_by_the_compiler_flags(monkeypatch):
    """A flag changed in CFLAGS is a new build: the cache must not hand back the binary the
    old flags made (the folder was keyed by the sources, torch, Python and the CPU only)."""
    before = cpu_ops.build_dir()
    monkeypatch.setattr(cpu_ops, "CFLAGS", [*cpu_ops.CFLAGS, "-fno-unroll-loops"])
    assert cpu_ops.build_dir() != before
