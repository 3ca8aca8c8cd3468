"""This process's temp folder (``hyv4-mtp-<pid>``): the vLLM model directories it writes
(a config.json each, read by vLLM for as long as an engine lives), removed when it ends."""

from __future__ import annotations


PROCESS_TEMP_PREFIX = "hyv4-mtp-"  # + this process's pid: the vLLM model directories it writes
_process_temp: list[tuple[int, str]] = []  # (the pid that made it, its path)


def process_temp_dir() -> str:
    """This process's folder under the system temp directory (``hyv4-mtp-<pid>``): vLLM reads its
    model directories (a config.json each) from it for as long as an engine lives. Removed when the
    process ends (``remove_process_temp_dir``: at exit, and by the entry points that skip exit
    hooks); a folder of a process that is gone (killed) is removed the next time one is made."""
    import atexit
    import os
    import re
    import tempfile

    if _process_temp and _process_temp[0][0] == os.getpid():
        return _process_temp[0][1]
    _process_temp.clear()  # a forked child makes its own (the parent's is the parent's to remove)
    base = tempfile.gettempdir()
    from ..atomic import pid_alive

    for entry in os.listdir(base):
        m = re.fullmatch(re.escape(PROCESS_TEMP_PREFIX) + r"(\d+)", entry)
        if m and int(m.group(1)) != os.getpid():
            _remove_if_owner_gone(os.path.join(base, entry), int(m.group(1)), pid_alive)
    path = os.path.join(base, f"{PROCESS_TEMP_PREFIX}{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    _hold_owner_lock(path)
    _process_temp.append((os.getpid(), path))
    atexit.register(remove_process_temp_dir)
    return path


OWNER_LOCK = ".owner.lock"
_owner_locks: list[int] = []  # open descriptors: each folder's lock lives as long as its process


def _hold_owner_lock(path: str) -> None:
    """Hold an exclusive ``flock`` on ``path/.owner.lock`` for this process's lifetime: another
    process (in another PID namespace sharing this temp directory too) sees the folder as owned."""
    import fcntl
    import os

    try:
        fd = os.open(os.path.join(path, OWNER_LOCK), os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # no lock to be had here: the pid check below still applies to the folder
        return
    _owner_locks.append(fd)


def _remove_if_owner_gone(path: str, pid: int, pid_alive) -> None:
    """Remove another process's temp folder when its owner is gone: its owner lock can be taken,
    or (a folder without one) no process has its pid here."""
    import fcntl
    import os
    import shutil

    lock = os.path.join(path, OWNER_LOCK)
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        if not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
        return
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its owner lives, whatever its pid means in this namespace
        os.close(fd)
        return
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)


def remove_process_temp_dir() -> None:
    """Remove this process's temp folder (``process_temp_dir``); a forked child leaves its parent's."""
    import os
    import shutil

    while _process_temp:
        pid, path = _process_temp.pop()
        if pid == os.getpid():
            shutil.rmtree(path, ignore_errors=True)
            while _owner_locks:
                os.close(_owner_locks.pop())
