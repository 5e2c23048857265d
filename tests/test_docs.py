"""Every ```python block in README.md and docs/*.md runs as written, on CPU, so a stale snippet fails CI.

Each block runs in a fresh interpreter (a subprocess: no state leaks between snippets, and a snippet
that crashes the process fails only its own test) from a temporary directory (files it writes stay
there). A block that cannot run on CPU (it needs a GPU or several processes) is preceded by the line
``<!-- docs-test: skip REASON -->``; keep such blocks few, and the reason says why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
def test_snippet_runs(path, line, code, skip, tmp_path):
    if skip is not None:
        pytest.skip(f"{path.name}:{line} opts out: {skip}")
    env = dict(os.environ)
    # The worktree's package (with its in-place extension) first; no downloads from any hub.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (
        f"the snippet at {path.relative_to(ROOT)}:{line} failed (exit {proc.returncode}):\n{code}\n"
        f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}")
