"""Read a ``--config`` YAML file defensively: bounded bytes, bounded expansion, no duplicates.

A config file is operator input, so it is read as hostile: only a regular file, at most
``MAX_CONFIG_BYTES``; aliases may not expand the document past ``MAX_CONFIG_NODES`` nodes
(a 398-byte "billion laughs" otherwise hangs every later walk of the tree); a key given
twice in one mapping is refused with its line instead of the last one silently winning.

Pure module: no prefect, no distributed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

MAX_CONFIG_BYTES = 1 << 20  # a run config is a few hundred bytes; 1 MiB is generous
MAX_CONFIG_NODES = 10_000  # nodes after alias expansion


class ConfigFileError(ValueError):
    """The file cannot be taken as a config; the message says why and what to do."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated within one mapping, naming key and line."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise ConfigFileError(
                        f"key {key!r} appears twice (line {seen[key]} and line {line}); keep one"
                    )
                seen[key] = line
            except TypeError:  # unhashable key: SafeLoader reports it below
                break
        return super().construct_mapping(node, deep=deep)


def _expanded_nodes(root: yaml.Node, budget: int) -> int:
    """How many nodes ``root`` has with every alias expanded, stopping once past ``budget``.

    Aliases are shared node objects in the composed graph, so a walk that follows them
    counts the expanded size; the walk stops at ``budget`` + 1, so it is O(budget)."""
    count = 0
    stack = [root]
    while stack:
        node = stack.pop()
        count += 1
        if count > budget:
            return count
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.extend((k, v))
    return count


def read_config_file(path: str | os.PathLike) -> Any:
    """The YAML document in ``path``, or ``ConfigFileError`` saying what is wrong with it."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as exc:
        raise ConfigFileError(f"{exc.strerror or exc}; give the path of a YAML file") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigFileError("not a regular file; give the path of a YAML file")
    with open(p, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigFileError(
            f"larger than {MAX_CONFIG_BYTES} bytes; a run config is a few settings"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    loader = _StrictLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        if _expanded_nodes(root, MAX_CONFIG_NODES) > MAX_CONFIG_NODES:
            raise ConfigFileError(
                f"expands past {MAX_CONFIG_NODES} values through YAML aliases (&/*); "
                "write the settings out"
            )
        return loader.construct_document(root)
    finally:
        loader.dispose()
