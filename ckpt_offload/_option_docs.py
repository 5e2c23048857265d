"""The options' descriptions, written once: the string under each field of a dataclass, read from
its source, and turned into a docstring's ``Args:`` or docs/api.md's table.

Each option of :class:`ckpt_offload.OffloadOptions` is described in the string under its field
(markdown-style `code`). co.offload's docstring, OffloadOptions' and the table in docs/api.md are
made from them (scripts/option_docs.py writes the table; tests/package/test_docs.py checks it is
current).
"""

from __future__ import annotations

import ast
import itertools
import re
import textwrap


def field_docs(path: str, class_name: str, keys) -> dict:
    """``{field: description}`` in the order of ``keys``: the string under each field of the class
    ``class_name`` in the source file ``path``, as one line. Empty where the source cannot be read
    (a frozen install): the docstrings then say less, the options work the same."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):  # pragma: no cover - no source
        return {}
    body = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return {k: docs[k] for k in keys if k in docs}


def _rst(text: str) -> str:
    """A description's `code` as reStructuredText's ``code``."""
    return re.sub(r"`([^`]+)`", r"``\1``", text)


def args_section(docs: dict, indent: int = 8) -> str:
    """``docs`` (``{name: description}``) as the entries of a docstring's ``Args:``, wrapped at
    100 columns, continuation lines 4 deeper.

    Example::

        args_section({"min_bytes": "The smallest tensor worth a copy."})
        # '        min_bytes: The smallest tensor worth a copy.'
    """
    lines = []
    for name, text in docs.items():
        lines += textwrap.wrap(
            f"{name}: {_rst(text)}",
            100,
            initial_indent=" " * indent,
            subsequent_indent=" " * (indent + 4),
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def markdown_table(docs: dict) -> str:
    """``docs`` as the argument table of docs/api.md (a description holds no ``|``)."""
    rows = ["| argument | meaning |", "| --- | --- |"]
    rows += [f"| `{name}` | {text} |" for name, text in docs.items()]
    return "\n".join(rows)
