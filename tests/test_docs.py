"""Every ```python block in README.md and docs/*.md runs as written, on CPU, so a stale snippet fails CI.

Each block runs in a fresh namespace (as ``__main__``) from a temporary directory (files it writes
stay there), in the test process: starting an interpreter and importing torch and transformers
for each of them would cost several seconds per block. conftest's checks apply to every block (no
bytes left in the default pool, no hooks left registered). Tracebacks point at the Markdown file
and its line numbers. A block that cannot run on CPU (it needs a GPU or several processes) is
preceded by the line ``<!-- docs-test: skip REASON -->``; keep such blocks few, and say why.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\b(.*?)-->")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def snippets():
    """(path, line, code, skip reason or None) for every python block of the documentation."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            out.append((path, line, m.group(1), skip.group(1).strip() if skip else None))
    return out


SNIPPETS = snippets()


def test_the_docs_have_snippets_and_few_skips():
    # The pattern must keep finding the blocks (a change of fence style would silently run nothing).
    assert len(SNIPPETS) >= 10
    skipped = [(p.name, line) for p, line, _, reason in SNIPPETS if reason is not None]
    assert len(skipped) <= 4, f"too many snippets opt out of the docs test: {skipped}"
    assert all(reason for _, _, _, reason in SNIPPETS if reason is not None), "every skip marker gives a reason"


@pytest.mark.parametrize("path,line,code,skip", SNIPPETS,
                         ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, _, _ in SNIPPETS])
def test_snippet_runs(path, line, code, skip, tmp_path, monkeypatch):
    if skip is not None:
        pytest.skip(f"{path.name}:{line} opts out: {skip}")
    monkeypatch.chdir(tmp_path)
    # Leading newlines make the compiled line numbers those of the Markdown file.
    compiled = compile("\n" * line + code, str(path), "exec")
    namespace = {"__name__": "__main__"}
    try:
        exec(compiled, namespace)
    finally:
        namespace.clear()  # what the snippet holds (handles, graphs) is let go before conftest's leak check
        gc.collect()


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_point_into_the_repository():
    # The README is the front page and links every topic in docs/: a moved or renamed page must
    # not leave a dead link behind.
    dead = []
    for path in DOCS:
        for target in LINK.findall(path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                dead.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not dead, f"links to files that do not exist: {dead}"
    assert "docs/" in (ROOT / "README.md").read_text()
