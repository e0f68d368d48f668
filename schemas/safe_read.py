"""Reading config files a user (or an attacker) hands us, within fixed bounds.

A config YAML and a model's `config.json` are small text files. Anything else at those
paths (a FIFO, `/dev/zero`, a 100 MB file, an alias bomb, 1000 nested lists, a number with a
million digits) is refused with one `ConfigError` naming the key, before it can hang the
process, exhaust its memory or blow the stack. The limits:

- a regular file (symlinks followed), at most `MAX_FILE_BYTES`, read with one bounded read;
- YAML checked on its event stream (no recursion, nothing built yet): nesting at most
  `MAX_DEPTH`, at most `MAX_NODES` nodes with every alias expanded (a "billion laughs"
  document of 9 anchors is 10^9 nodes), scalars at most `MAX_SCALAR` characters.
"""

from __future__ import annotations

import os
import stat
from typing import Any, BinaryIO

from .errors import ConfigError

MAX_FILE_BYTES = 1 << 20
"""Largest config file read (HF config.json files and our YAMLs are a few KB)."""
MAX_DEPTH = 32
"""Deepest nesting of YAML collections (our configs use 3)."""
MAX_NODES = 100_000
"""Most YAML nodes, aliases expanded."""
MAX_SCALAR = 4096
"""Longest YAML scalar (a path, a number); Python refuses ints of more than 4300 digits."""

def short(value: object, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: an error line stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...>"


KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str], label: str, fix: str,
                 error: type[Exception]) -> BinaryIO:
    """`path` opened for reading in binary, only if it is a regular file (symlinks
    followed): a FIFO, a device, a socket or a folder is refused at once (opened without
    blocking, checked on the open descriptor), as is a NUL byte in the path. Errors are
    `error("{label}: {path!r} ...; {fix}")`, one line."""
    name = os.fspath(path)
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    if "\0" in name:
        raise error(f"{label}: {short(name)} has a NUL byte in it; {fix}")
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{label}: {short(name)} does not exist; {fix}") from None
    except OSError as e:
        raise error(f"{label}: {short(name)} cannot be opened ({e.strerror}); {fix}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{label}: {short(name)} is {_kind(mode)}, not a regular file; {fix}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: str, key: str, what: str) -> str:
    """The text of the regular file `path`, at most `MAX_FILE_BYTES`; else a ConfigError
    naming `key` (the config key that gave the path) and `what` the file should be."""
    if "\0" in str(path):
        raise ConfigError(f"{key}: {short(path)} has a NUL byte in it; give the path to {what}")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key}: {path!r} is not a regular file; give the path to {what}")
        if st.st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{key}: {path!r} is {st.st_size:,} bytes, more than the "
                              f"{MAX_FILE_BYTES:,} a config may have; give the path to {what}")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path!r} does not exist; give the path to {what}") from None
    except IsADirectoryError:
        raise ConfigError(f"{key}: {path!r} is a folder; give the path to {what}") from None
    except OSError as e:
        raise ConfigError(f"{key}: {path!r} cannot be read ({e.strerror}); give the path to "
                          f"{what}") from None
    if len(data) > MAX_FILE_BYTES:  # it grew between stat and read
        raise ConfigError(f"{key}: {path!r} is more than {MAX_FILE_BYTES:,} bytes; give the "
                          f"path to {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {path!r} is not UTF-8 text (byte {e.start}); give the path "
                          f"to {what}") from None


def _where(event: Any) -> str:
    mark = getattr(event, "start_mark", None)
    return f" at line {mark.line + 1}" if mark is not None else ""


def check_yaml_events(text: str, path: str) -> None:
    """Walk the YAML event stream once and refuse documents beyond the bounds above."""
    import yaml

    def fail(event: Any, problem: str, fix: str) -> None:
        raise ConfigError(f"config file: {path!r}{_where(event)}: {problem}; {fix}")

    sizes: dict[str, int] = {}  # anchor -> nodes of its value, aliases expanded
    stack: list[list[Any]] = []  # [anchor, nodes so far] per open collection
    nodes = 0

    def add(event: Any, n: int) -> None:
        nonlocal nodes
        nodes += n
        if stack:
            stack[-1][1] += n
        if nodes > MAX_NODES:
            fail(event, f"expands to more than {MAX_NODES:,} nodes (YAML aliases)",
                 "write the config without repeated aliases")

    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(ev, yaml.AliasEvent):
            add(ev, sizes.get(ev.anchor, 1))
        elif isinstance(ev, yaml.ScalarEvent):
            if len(ev.value) > MAX_SCALAR:
                fail(ev, f"holds a value of {len(ev.value):,} characters",
                     f"values have at most {MAX_SCALAR}")
            add(ev, 1)
            if ev.anchor:
                sizes[ev.anchor] = 1
        elif isinstance(ev, yaml.CollectionStartEvent):
            if len(stack) >= MAX_DEPTH:
                fail(ev, f"nests deeper than {MAX_DEPTH} levels",
                     "a config has sections of keys, nothing deeper")
            add(ev, 1)
            stack.append([ev.anchor, 1])
        elif isinstance(ev, yaml.CollectionEndEvent):
            anchor, n = stack.pop()
            if anchor:
                sizes[anchor] = n
            if stack:
                stack[-1][1] += n - 1  # its nodes beyond the start node already counted
