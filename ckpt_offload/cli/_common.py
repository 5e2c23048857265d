"""What the commands of ``python -m ckpt_offload`` share: argument types, loading a user's
script, checking the output folder, and the exit status of a failed write."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["load_script", "write_failed", "EXIT_WRITE_FAILED"]


def _int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, with an error that says so."""

    def parse(text: str) -> int:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


class heartbeat:
    """``with heartbeat("measuring"):`` prints ``what`` on stderr, then every ``every`` seconds a
    line with the time it has taken so far, and at the end how long it took: a step of a command
    that can run for minutes shows that it runs."""

    def __init__(self, what: str, every: float = 10.0, stream=None):
        import threading

        self.what, self.every, self.stream = what, every, stream or sys.stderr
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _beat(self) -> None:
        while not self._done.wait(self.every):
            self._say(f"  ... {self._elapsed():.0f} s")

    def _elapsed(self) -> float:
        import time

        return time.monotonic() - self._start

    def __enter__(self):
        import time

        self._start = time.monotonic()
        self._say(f"{self.what} ...")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        if exc[0] is None:
            self._say(f"  done in {self._elapsed():.1f} s")


def _size(text: str) -> int:
    """An argparse type for a byte count: an int or a size string ("64KiB", "1.5MB"), as every
    byte argument of the Python API takes."""
    from ckpt_offload._args import parse_bytes

    try:
        return parse_bytes("size", text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(
            f"expected a number of bytes or a size such as '64KiB' or '1.5MB', got {text!r}"
            + (f" ({str(e).removeprefix('size: ')})" if "whole number" in str(e) else "")
        ) from None


def load_script(spec: str, parser):
    """``path/to/file.py:function`` -> the function, or a parser error saying what is wrong."""
    import importlib.util
    import os

    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        parser.error(f"--script: expected FILE.py:FUNCTION, got {spec!r}")
    if not name.isidentifier():
        parser.error(f"--script: {name!r} is not a function name (expected FILE.py:FUNCTION)")
    if not os.path.isfile(path):
        parser.error(f"--script: no such file: {path!r}")
    mod_name = "_ckpt_offload_profile_script_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        parser.error(f"--script: cannot import {path!r} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)  # the script's own imports of its neighbours work as when run directly
    try:
        module_spec.loader.exec_module(module)
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    fn = getattr(module, name, None)
    if fn is None:
        parser.error(f"--script: {path!r} has no attribute {name!r}")
    if not callable(fn):
        parser.error(f"--script: {path}:{name} is a {type(fn).__name__}, not a function")
    return fn


def _check_out(out: str, parser) -> None:
    """A parser error before any step runs when ``out`` cannot be the output folder: minutes of
    profiling (or planning) would otherwise be lost at the end. Creates the folder and writes a
    file in it (removed at once): permission bits alone do not say whether a write will work
    (root ignores them; a read-only file system does not)."""
    import tempfile

    if os.path.exists(out) and not os.path.isdir(out):
        parser.error(f"--out: {out!r} exists and is not a folder; pass a folder path")
    # The topmost folder this check creates: removed again, so that a run stopped by a later
    # argument error leaves nothing behind (the run itself creates the folder when it writes).
    created = None
    path = os.path.abspath(out)
    while not os.path.exists(path):
        created, path = path, os.path.dirname(path)
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".ckpt_offload_write_check_")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        parser.error(f"--out: cannot write to {out!r} ({e.strerror or e}); pass a folder you can write to")
    finally:
        if created is not None:
            import shutil

            shutil.rmtree(created, ignore_errors=True)


#: Exit status when an output file cannot be written at the end (the disk filled up, the folder
#: went away): distinct from 1 (a failed check) and 2 (bad arguments).
EXIT_WRITE_FAILED = 3


def write_failed(what: str, error: OSError) -> int:
    """Prints why ``what`` could not be written and returns :data:`EXIT_WRITE_FAILED`."""
    print(
        f"ckpt_offload: cannot write {what}: {error.strerror or error} "
        f"({getattr(error, 'filename', None) or what}); the results above are complete, only the files are missing",
        file=sys.stderr,
    )
    return EXIT_WRITE_FAILED
