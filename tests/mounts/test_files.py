"""apiary.mounts.files: nothing inside a root leads outside it, and a write is whole or absent.

Every test runs twice: with openat2 (symlinks inside the root are followed) and with the
component-wise O_NOFOLLOW walk of kernels without it (every symlink refused)."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from apiary.errors import ConflictError, NotFoundError, PayloadTooLargeError, ValidationError
from apiary.mounts import files


@pytest.fixture(params=[True, False], ids=["openat2", "walk"])
def openat2(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param and not files.USE_OPENAT2:
        pytest.skip("this kernel has no openat2")
    monkeypatch.setattr(files, "USE_OPENAT2", request.param)
    return bool(request.param)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/ with d/f ("data"), in-root symlinks (dl -> d, fl -> d/f) and escapes: etc -> /etc,
    d/up -> ../../outside, a chain c1 -> c2 -> /etc, and a secret outside the root."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("secret")
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_text("data")
    (root / "dl").symlink_to("d")
    (root / "fl").symlink_to("d/f")
    (root / "etc").symlink_to("/etc")
    (root / "d" / "up").symlink_to("../../outside")
    (root / "c2").symlink_to("/etc")
    (root / "c1").symlink_to("c2")
    (root / "abs").symlink_to(tmp_path / "outside")
    return root


@pytest.mark.parametrize("path", ["../outside/secret", "d/../../outside/secret", "/etc/passwd", "d/f\0x"])
@pytest.mark.usefixtures("openat2")
def test_bad_paths_are_refused_before_any_open(tree: Path, path: str) -> None:
    for op in (lambda: files.open_read(tree, path), lambda: files.list_dir(tree, path),
               lambda: files.stat(tree, path), lambda: files.remove(tree, path),
               lambda: files.make_dirs(tree, path),
               lambda: files.write_stream(tree, path, [b"x"], max_bytes=10)):
        with pytest.raises(ValidationError) as e:
            op()
        assert e.value.field == "path"
    assert (tree.parent / "outside" / "secret").read_text() == "secret"


@pytest.mark.parametrize("path", ["etc/passwd", "d/up/secret", "c1/passwd", "abs/secret", "etc", "c1"])
@pytest.mark.usefixtures("openat2")
def test_symlinks_out_of_the_root_are_refused(tree: Path, path: str) -> None:
    with pytest.raises(ValidationError, match="escapes|symlink|not a directory"):
        files.open_read(tree, path)
    with pytest.raises(ValidationError):
        files.list_dir(tree, path + "/")
    with pytest.raises(ValidationError):
        files.write_stream(tree, path + "/planted", [b"x"], max_bytes=10)
    with pytest.raises(ValidationError):
        files.make_dirs(tree, path + "/new")
    assert not Path("/etc/new").exists() and not (tree.parent / "outside" / "planted").exists()


def test_symlinks_inside_the_root_work_with_openat2(tree: Path, openat2: bool) -> None:
    if not openat2:
        with pytest.raises(ValidationError):
            files.open_read(tree, "dl/f")
        with pytest.raises(ValidationError):
            files.open_read(tree, "fl")
        return
    f, size = files.open_read(tree, "dl/f")
    with f:
        assert (f.read(), size) == (b"data", 4)
    f, _ = files.open_read(tree, "fl")
    with f:
        assert f.read() == b"data"
    assert [e["name"] for e in files.list_dir(tree, "dl")] == ["f", "up"]


@pytest.mark.usefixtures("openat2")
def test_list_and_stat_report_symlinks_as_such(tree: Path) -> None:
    entries = {e["name"]: e for e in files.list_dir(tree, "")}
    assert [n for n in entries] == sorted(entries)
    assert entries["d"]["type"] == "dir" and entries["etc"]["type"] == "symlink" and entries["fl"]["type"] == "symlink"
    assert files.stat(tree, "d/f") | {"mtime": 0} == {"name": "f", "type": "file", "size": 4, "mtime": 0}
    assert files.stat(tree, "etc")["type"] == "symlink"
    assert files.stat(tree, ".")["type"] == "dir"
    assert files.list_dir(tree, "d/f")[0]["name"] == "f"  # a file lists as itself
    with pytest.raises(NotFoundError):
        files.stat(tree, "nope")
    with pytest.raises(NotFoundError):
        files.list_dir(tree, "nope/deeper")


@pytest.mark.usefixtures("openat2")
def test_write_is_atomic_and_refuses_overwrite_unless_asked(tree: Path) -> None:
    assert files.write_stream(tree, "d/new", [b"ab", b"cd"], max_bytes=4) == 4
    assert (tree / "d" / "new").read_bytes() == b"abcd"
    assert stat.S_IMODE((tree / "d" / "new").stat().st_mode) == files.FILE_MODE
    with pytest.raises(ConflictError):
        files.write_stream(tree, "d/new", [b"zz"], max_bytes=4)
    assert (tree / "d" / "new").read_bytes() == b"abcd"
    assert files.write_stream(tree, "d/new", [b"zz"], max_bytes=4, overwrite=True) == 2
    assert (tree / "d" / "new").read_bytes() == b"zz"
    with pytest.raises(ConflictError):
        files.write_stream(tree, "d", [b"zz"], max_bytes=4, overwrite=True)
    with pytest.raises(NotFoundError):
        files.write_stream(tree, "missing/x", [b"zz"], max_bytes=4)
    assert sorted(os.listdir(tree / "d")) == ["f", "new", "up"]


@pytest.mark.usefixtures("openat2")
def test_over_the_limit_leaves_nothing(tree: Path) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"x" * 6
        yield b"y" * 6
        raise AssertionError("read past the limit")

    with pytest.raises(PayloadTooLargeError) as e:
        files.write_stream(tree, "d/big", chunks(), max_bytes=10)
    assert e.value.status_code == 413 and "10 bytes" in str(e.value)
    assert sorted(os.listdir(tree / "d")) == ["f", "up"]
    # and a failing source leaves nothing either
    def broken() -> Iterator[bytes]:
        yield b"x"
        raise OSError("client went away")

    with pytest.raises(OSError, match="went away"):
        files.write_stream(tree, "d/big", broken(), max_bytes=10)
    assert sorted(os.listdir(tree / "d")) == ["f", "up"]


@pytest.mark.usefixtures("openat2")
def test_make_dirs_are_sticky_and_world_writable(tree: Path) -> None:
    files.make_dirs(tree, "a/b/c")
    for p in ("a", "a/b", "a/b/c"):
        assert stat.S_IMODE((tree / p).stat().st_mode) == files.DIR_MODE == 0o1777
    files.make_dirs(tree, "a/b/c")  # idempotent
    os.chmod(tree / "d", 0o755)
    files.make_dirs(tree, "d/sub")
    assert stat.S_IMODE((tree / "d").stat().st_mode) == 0o755  # existing ones untouched
    with pytest.raises(ValidationError):
        files.make_dirs(tree, "d/f/x")


@pytest.mark.usefixtures("openat2")
def test_remove_removes_links_not_targets(tree: Path) -> None:
    files.remove(tree, "etc")
    files.remove(tree, "d/up")
    assert Path("/etc/passwd").exists() and (tree.parent / "outside" / "secret").exists()
    (tree / "d" / "inner").symlink_to(tree.parent / "outside")
    with pytest.raises(ConflictError):
        files.remove(tree, "d")
    files.remove(tree, "d", recursive=True)
    assert not (tree / "d").exists() and (tree.parent / "outside" / "secret").exists()
    with pytest.raises(ValidationError):
        files.remove(tree, "")
    with pytest.raises(NotFoundError):
        files.remove(tree, "d")


@pytest.mark.usefixtures("openat2")
def test_open_read_refuses_a_fifo_without_blocking(tree: Path) -> None:
    os.mkfifo(tree / "pipe")
    done = threading.Event()

    def read() -> None:
        with pytest.raises(ValidationError, match="not a regular file"):
            files.open_read(tree, "pipe")
        done.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert done.wait(10), "open_read blocked on a FIFO"
    with pytest.raises(ValidationError, match="directory|regular"):
        files.open_read(tree, "d")


def test_real_path_has_no_symlinks(tree: Path, openat2: bool) -> None:
    assert files.real_path(tree, "d") == Path(os.path.realpath(tree / "d"))
    if openat2:
        assert files.real_path(tree, "dl") == Path(os.path.realpath(tree / "d"))
    with pytest.raises(ValidationError):
        files.real_path(tree, "etc")
