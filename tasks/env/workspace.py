"""File tools over an agent's workspace: write, read, list; nothing outside it, no links.

What the ``repo`` suite's ``write_file`` / ``read_file`` / ``list_files`` tools do. Paths are
relative to the workspace, normalised, and refused when they leave it (``..``, absolute
paths) or pass through a symbolic link (agent code run by ``run_tests`` can create links, so
every component is checked and files are opened with ``O_NOFOLLOW``). Sizes are bounded.

Pure module (file I/O in the given directory only): no prefect, no distributed.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

MAX_FILE_BYTES = 64_000
MAX_READ_CHARS = 6_000
MAX_FILES = 200
MAX_PATH = 200


class ToolError(Exception):
    """A tool call the workspace refuses; its message is the tool result the agent sees."""


def rel_path(workdir: str, path: Any) -> str:
    """A safe relative path inside ``workdir`` (no absolute paths, ``..``, dot-dirs or links)."""
    if not isinstance(path, str) or not path.strip():
        raise ToolError("error: path must be a non-empty string")
    p = path.strip().replace("\\", "/")
    if len(p) > MAX_PATH or "\0" in p:
        raise ToolError("error: path too long or invalid")
    if p.startswith("/"):
        raise ToolError("error: use a path relative to the workspace")
    parts = [x for x in p.split("/") if x not in ("", ".")]
    if not parts or any(x == ".." for x in parts):
        raise ToolError("error: the path must stay inside the workspace")
    full = os.path.join(workdir, *parts)
    # every existing component must be a real directory/file inside the workspace
    cur = workdir
    for x in parts:
        cur = os.path.join(cur, x)
        if os.path.islink(cur):
            raise ToolError(f"error: {'/'.join(parts)}: symbolic links are not followed")
    real_ws = os.path.realpath(workdir)
    if not os.path.realpath(full).startswith(real_ws + os.sep):
        raise ToolError("error: the path must stay inside the workspace")
    return "/".join(parts)


def write_file(workdir: str, path: Any, content: Any) -> str:
    rel = rel_path(workdir, path)
    if not isinstance(content, str):
        raise ToolError("error: content must be a string")
    data = content.encode()
    if len(data) > MAX_FILE_BYTES:
        raise ToolError(f"error: file larger than {MAX_FILE_BYTES} bytes")
    full = os.path.join(workdir, rel)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    rel_path(workdir, rel)  # again: a directory made above could not have been a link
    try:
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise ToolError(
            f"error: cannot write {rel}: {os.strerror(exc.errno or errno.EIO)}"
        ) from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return f"wrote {rel} ({len(data)} bytes)"


def read_file(workdir: str, path: Any) -> str:
    rel = rel_path(workdir, path)
    full = os.path.join(workdir, rel)
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ToolError(f"error: cannot read {rel}: {os.strerror(exc.errno or errno.EIO)}") from exc
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ToolError(f"error: {rel} is not a file")
        data = f.read(MAX_READ_CHARS * 4 + 1)
    text = data.decode("utf-8", "replace")
    if len(text) > MAX_READ_CHARS:
        text = text[:MAX_READ_CHARS] + "\n[... truncated ...]"
    return text


def list_files(workdir: str) -> str:
    out = []
    for dirpath, dirnames, filenames in os.walk(workdir):  # never follows links
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".pytest_cache"))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, workdir)
            out.append(f"{rel} ({os.lstat(full).st_size} bytes)")
            if len(out) >= MAX_FILES:
                return "\n".join([*out, "[... more files ...]"])
    return "\n".join(out) or "(no files)"
