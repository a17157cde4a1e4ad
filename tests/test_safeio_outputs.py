"""Outputs: only a regular file (or nothing) is ever replaced; a symbolic link is followed; a
device, FIFO or folder is refused with one line before any work (never the real /dev/null here).
Outputs get the permissions of an ordinary write (umask), not a temporary file's 0o600."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from sdc_core.cli import EXIT_OK, EXIT_UNREADABLE
from sdc_core.cli import main as sdc
from sdc_core.dist.topology import RankFacts, Topology
from sdc_core.errors import FingerprintMismatchError
from sdc_core.io.safe_files import OutputError, atomic_write_text, check_output, create_unique
from sdc_core.ops.incidents import write_incident


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    path = tmp_path / "good.pt"
    torch.save({"w": torch.arange(16, dtype=torch.float32), "b": torch.ones(3)}, path)
    return path


def test_a_fifo_is_refused_and_left_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="FIFO") as err:
        atomic_write_text(fifo, "hello")
    assert str(fifo) in str(err.value) and "\n" not in str(err.value)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]  # no temporary file left behind


def test_a_link_to_a_fifo_is_refused_and_both_stay(tmp_path: Path) -> None:
    fifo, link = tmp_path / "pipe", tmp_path / "out.json"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    with pytest.raises(OutputError, match="a link to"):
        atomic_write_text(link, "hello")
    assert stat.S_ISLNK(os.lstat(link).st_mode) and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_link_to_a_regular_file_is_followed_and_stays_a_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target, link = tmp_path / "real" / "config.yaml", tmp_path / "config.yaml"
    target.write_text("old")
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert stat.S_ISLNK(os.lstat(link).st_mode) and target.read_text() == "new"
    dangling = tmp_path / "later.json"
    dangling.symlink_to(tmp_path / "real" / "later.json")
    atomic_write_text(dangling, "{}")
    assert (tmp_path / "real" / "later.json").read_text() == "{}" and dangling.is_symlink()


def test_a_link_loop_and_a_folder_are_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    with pytest.raises(OutputError, match="loop"):
        check_output(a)
    with pytest.raises(OutputError, match="folder"):
        check_output(tmp_path)


def test_corrupt_checkpoint_refuses_a_fifo_output_with_one_line(plain: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    fifo = tmp_path / "null"
    os.mkfifo(fifo)
    before = plain.read_bytes()
    assert sdc(["corrupt-checkpoint", str(plain), "-o", str(fifo)]) == EXIT_UNREADABLE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "FIFO" in err and str(fifo) in err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and plain.read_bytes() == before
    assert not Path(f"{fifo}.flips.json").exists()  # refused before anything was written
    assert sdc(["corrupt-checkpoint", str(plain), "-o", str(tmp_path / "bad.pt")]) == EXIT_OK


@pytest.fixture
def umask_022() -> Any:
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_outputs_honour_the_umask_as_an_ordinary_write(tmp_path: Path, plain: Path, umask_022: Any) -> None:
    atomic_write_text(tmp_path / "new.json", "{}")
    assert mode(tmp_path / "new.json") == 0o644  # not mkstemp's 0o600: another account can read it
    kept = tmp_path / "kept.yaml"
    kept.write_text("a")
    os.chmod(kept, 0o640)
    atomic_write_text(kept, "b")
    assert mode(kept) == 0o640 and kept.read_text() == "b"  # a replaced file keeps its mode
    assert mode(create_unique(tmp_path, "incident", ".json", "{}")) == 0o644
    err = FingerprintMismatchError(step=3, rank=0, suspects=(0,), hosts={0: "node-a"})
    incident = write_incident(tmp_path / "run", err, Topology((RankFacts(0, "node-a", 0, 0),), 0), {}, "raise")
    assert mode(incident) == 0o644
    assert sdc(["corrupt-checkpoint", str(plain), "-o", str(tmp_path / "bad.pt")]) == EXIT_OK
    assert mode(tmp_path / "bad.pt") == 0o644 and mode(tmp_path / "bad.pt.flips.json") == 0o644
    os.umask(0o077)
    atomic_write_text(tmp_path / "private.json", "{}")
    assert mode(tmp_path / "private.json") == 0o600


def test_an_altered_folder_copy_honours_the_umask(tmp_path: Path, umask_022: Any) -> None:
    src = tmp_path / "state"
    src.mkdir()
    torch.save({"w": torch.ones(8)}, src / "pytorch_model.bin")
    assert sdc(["corrupt-checkpoint", str(src), "-o", str(tmp_path / "copy")]) == EXIT_OK
    assert mode(tmp_path / "copy") == 0o755 and mode(tmp_path / "copy" / "pytorch_model.bin") == 0o644
