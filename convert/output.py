"""Atomic output directories: write into a temp dir beside OUT, rename on success."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .errors import ConvertError

TMP_TAG = ".sparkq-tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> None:
    """Remove temp dirs left beside OUT by runs that were killed."""
    for p in out.parent.glob(f".{out.name}{TMP_TAG}*"):
        try:
            pid = int(p.name.rsplit("-", 1)[-1])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, force: bool = False):
    out = Path(out).absolute()
    if out.exists() and not force:
        raise ConvertError(f"{out} already exists; choose another output or pass --force to replace it")
    if not out.parent.is_dir():
        raise ConvertError(f"{out.parent}: output's parent directory does not exist; create it first")
    clean_stale(out)
    tmp = out.parent / f".{out.name}{TMP_TAG}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():  # --force: swap in, then drop the old one
            old = out.parent / f".{out.name}{TMP_TAG}old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
