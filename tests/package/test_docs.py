"""Every ```python block in README.md and docs/*.md runs as written, on CPU, so a stale snippet fails CI.

Each block runs in a fresh namespace (as ``__main__``) from a temporary directory (files it writes
stay there), in the test process: starting an interpreter and importing torch and transformers
for each of them would cost several seconds per block. conftest's checks apply to every block (no
bytes left in the default pool, no hooks left registered). Tracebacks point at the Markdown file
and its line numbers. A block that cannot run on CPU (it needs a GPU or several processes) is
preceded by the line ``<!-- docs-test: skip REASON -->``; keep such blocks few, and say why. A
skipped block must still be complete (every name it uses defined in it) and, run here, fail only
for the reason stated (no process group, no GPU). Prose is checked too: a paragraph that stops
mid-sentence (no closing punctuation before a blank line or a heading) fails. A block that
offloads nothing while it sets out to (ckpt_offload's "offloaded none of them" warning: every
saved tensor under ``min_bytes``, or on a device the context does not offload) fails too; a block
whose text says it offloads nothing on purpose is preceded by
``<!-- docs-test: offloads nothing REASON -->``.
"""

from __future__ import annotations

import ast
import builtins
import gc
import re
from pathlib import Path

import pytest
from helpers import REPO_ROOT

ROOT = Path(REPO_ROOT)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\b(.*?)-->")
OFFLOADS_NOTHING = re.compile(r"<!--\s*docs-test:\s*offloads nothing\b(.*?)-->")
NOTHING_WARNING = "offloaded none of them"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def snippets():
    """(path, line, code, skip reason or None) for every python block of the documentation."""
    return [(path, line, code, skip) for path, line, code, skip, _ in _blocks()]


def _blocks():
    """snippets() with, last, the block's reason to offload nothing (or None)."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            nothing = OFFLOADS_NOTHING.search(before)
            out.append(
                (
                    path,
                    line,
                    m.group(1),
                    skip.group(1).strip() if skip else None,
                    nothing.group(1).strip() if nothing else None,
                )
            )
    return out


NOTHING_ON_PURPOSE = {(p, line): reason for p, line, _, _, reason in _blocks() if reason is not None}


SNIPPETS = snippets()


def test_the_docs_have_snippets_and_few_skips():
    # The pattern must keep finding the blocks (a change of fence style would silently run nothing).
    assert len(SNIPPETS) >= 10
    skipped = [(p.name, line) for p, line, _, reason in SNIPPETS if reason is not None]
    assert len(skipped) <= 4, f"too many snippets opt out of the docs test: {skipped}"
    assert all(reason for _, _, _, reason in SNIPPETS if reason is not None), "every skip marker gives a reason"


@pytest.mark.parametrize(
    "path,line,code,skip", SNIPPETS, ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, _, _ in SNIPPETS]
)
def test_snippet_runs(path, line, code, skip, tmp_path, monkeypatch):
    if skip is not None:
        pytest.skip(f"{path.name}:{line} opts out: {skip}")
    monkeypatch.chdir(tmp_path)
    # Leading newlines make the compiled line numbers those of the Markdown file.
    compiled = compile("\n" * line + code, str(path), "exec")
    namespace = {"__name__": "__main__"}
    offloaded_nothing = run_recording_offloaded_nothing(compiled, namespace, monkeypatch)
    reason = NOTHING_ON_PURPOSE.get((path, line))
    if reason is None:
        assert not offloaded_nothing, (
            f"{path.name}:{line} offloads nothing, while its text says it offloads: {offloaded_nothing[0]}"
        )
    else:
        assert reason, f"{path.name}:{line}: an 'offloads nothing' marker gives a reason"


def run_recording_offloaded_nothing(compiled, namespace, monkeypatch) -> list:
    """Runs the compiled block; returns the "offloaded none of them" warnings it raised (each
    block starts with a fresh once-per-site table, so an earlier run cannot silence one)."""
    import warnings

    from ckpt_offload import _warn

    monkeypatch.setattr(_warn, "_warned_sites", set())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compiled, namespace)
    finally:
        namespace.clear()  # what the snippet holds (handles, graphs) is let go before conftest's leak check
        gc.collect()
    for w in caught:  # shown as usual: the block's other warnings stay visible
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return [str(w.message) for w in caught if NOTHING_WARNING in str(w.message)]


def test_a_block_that_offloads_nothing_is_caught(monkeypatch):
    # The check itself: a block with every saved tensor under the default min_bytes.
    code = (
        "import torch, ckpt_offload as co\n"
        "x = torch.randn(4, requires_grad=True)\n"
        "with co.offload(devices=['cpu']):\n"
        "    y = (x * x).sum()\n"
        "y.backward()\n"
    )
    found = run_recording_offloaded_nothing(compile(code, "example.md", "exec"), {"__name__": "__main__"}, monkeypatch)
    assert found and "min_bytes" in found[0]
    fixed = code.replace("devices=['cpu']", "devices=['cpu'], min_bytes=0")
    assert (
        run_recording_offloaded_nothing(compile(fixed, "example.md", "exec"), {"__name__": "__main__"}, monkeypatch)
        == []
    )


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


# -- skipped blocks: complete, and failing here only for the reason they state -------------------

# What a skip reason may say the block needs, and how its absence shows in the error raised here.
NEEDS = {
    "process group": r"process group|RANK|WORLD_SIZE|MASTER_ADDR|init_process_group|torch\.distributed",
    "GPU": r"CUDA|cuda|GPU|NVIDIA|nccl|NCCL",
    "deepspeed": r"No module named '?deepspeed",  # a machine without it (CI installs it; a GPU machine may not)
}


def undefined_names(code: str) -> set:
    """Names a block reads that it never defines (imports, assignments, loops, defs, arguments,
    ``with ... as``, ``except ... as``) and that are not builtins: the NameError it would hit
    once past what it is skipped for."""
    tree = ast.parse(code)
    bound, loaded = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


def test_undefined_names_finds_what_a_block_does_not_define():
    assert undefined_names("import os\nx = os.sep\nprint(x, model(batch))") == {"model", "batch"}
    assert undefined_names("def f(a):\n    return [b for b in a]\nwith open('f') as g:\n    f(g)") == set()


SKIPPED = [(p, line, code, reason) for p, line, code, reason in SNIPPETS if reason is not None]


@pytest.mark.parametrize(
    "path,line,code,skip", SKIPPED, ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, _, _ in SKIPPED]
)
def test_skipped_snippet_fails_only_for_its_stated_reason(path, line, code, skip, tmp_path, monkeypatch):
    where = f"{path.relative_to(ROOT)}:{line}"
    missing = undefined_names(code)
    assert not missing, f"{where}: the block uses {sorted(missing)} without defining them: make it complete"
    stated = [pattern for need, pattern in NEEDS.items() if need in skip]
    assert stated, f"{where}: the skip reason {skip!r} names none of {list(NEEDS)}"
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # not launched by torchrun here
    compiled = compile("\n" * line + code, str(path), "exec")
    namespace = {"__name__": "__main__"}
    try:
        exec(compiled, namespace)  # noqa: S102  (the block, as test_snippet_runs runs it)
    except Exception as e:  # noqa: BLE001  (expected: what the reason says is missing here)
        message = f"{type(e).__name__}: {e}"
        assert any(re.search(p, message) for p in stated), (
            f"{where} fails for a reason its skip does not state ({skip!r}): {message}"
        )
    else:
        pytest.fail(f"{where} runs here: remove its skip marker")
    finally:
        namespace.clear()
        gc.collect()


# -- prose: no paragraph stops mid-sentence -----------------------------------------------------

PROSE = [*DOCS, ROOT / "benchmarks" / "README.md"]
# A paragraph's last line ends a sentence, a code span, a parenthesis, a list lead-in (":"), an
# emphasis or a table cell.
ENDS_A_SENTENCE = re.compile(r"[.:!?)`*>|]$")


def unfinished_paragraphs(text: str) -> list:
    """(line, last line) of every paragraph outside code fences, tables, headings and HTML
    comments whose last line does not end a sentence."""
    out, current, fence = [], None, False
    lines = text.split("\n")
    for i, raw in enumerate(lines + [""], 1):
        line = raw.strip()
        if line.startswith("```"):
            fence = not fence
        if fence or not line or line.startswith(("```", "#", "|", "<!--")):
            if current is not None and not ENDS_A_SENTENCE.search(current[1]):
                out.append(current)
            current = None
            continue
        current = (i, line)
    return out


def test_unfinished_paragraphs_finds_a_truncated_sentence():
    assert unfinished_paragraphs("Cap each pool with\n\n## Next\nDone.\n") == [(1, "Cap each pool with")]
    assert unfinished_paragraphs("A list:\n\n- one\n- two.\n\n```python\nx = 1\n```\n") == []


@pytest.mark.parametrize("path", PROSE, ids=[str(p.relative_to(ROOT)) for p in PROSE])
def test_no_paragraph_stops_mid_sentence(path):
    bad = unfinished_paragraphs(path.read_text())
    assert not bad, f"{path.relative_to(ROOT)}: paragraphs that stop mid-sentence: {bad}"


# -- reference lists that must follow the code --------------------------------------------------


def test_api_md_lists_every_stats_key_and_reason():
    import ckpt_offload as co

    text = (ROOT / "docs" / "api.md").read_text()
    stats = co.offload(devices=["cpu"]).stats()
    missing = [k for k in [*stats, *stats["kept_by_reason"]] if f"`{k}`" not in text]
    assert not missing, f"docs/api.md's ctx.stats() list lacks {missing}"


def test_integrations_md_names_every_logged_trainer_key():
    co = pytest.importorskip("ckpt_offload")
    pytest.importorskip("transformers")
    text = (ROOT / "docs" / "integrations.md").read_text()
    missing = [k for k in [f"{k}_per_step" for k in co.hf.PER_STEP_KEYS] + list(co.hf.PEAK_KEYS) if k not in text]
    assert not missing, f"docs/integrations.md does not name the logged keys {missing}"


def test_ci_runs_the_readmes_test_command_first_then_the_release_checks():
    ci = (ROOT / ".ci" / "run").read_text()
    dev = (ROOT / "scripts" / "dev.sh").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "exec bash scripts/dev.sh ci" in ci
    assert "bash scripts/dev.sh test" in readme and "`bash scripts/dev.sh ci`" in readme
    ci_branch = dev[dev.index("\n  ci)") :]
    ci_branch = ci_branch[: ci_branch.index(";;")]
    assert ci_branch.index("run_tests") < ci_branch.index("run_release_checks"), ci_branch
    test_branch = dev[dev.index("\n  test)") :]
    test_branch = test_branch[: test_branch.index(";;")]
    assert "run_release_checks" not in test_branch  # the user's command stays the fast one
    release = dev[dev.index("run_release_checks() {") :]
    release = release[: release.index("\n}\n")]
    for check in ("lint.sh", "CKPT_OFFLOAD_TSAN=ON", "check_torch_headers.sh", "check_sdist.sh"):
        assert check in release and check not in dev[dev.index("run_tests() {") : dev.index("run_release_checks() {")]


def test_each_option_is_described_once_and_the_docstrings_and_api_md_are_made_from_it():
    """The string under each OffloadOptions field is that option's one description: co.offload's
    docstring, OffloadOptions' and the table in docs/api.md are made from it."""
    import importlib.util
    import dataclasses

    import ckpt_offload as co
    from ckpt_offload.offloading import argument_docs
    from ckpt_offload.options import OFFLOAD_KEYS, option_docs

    docs = option_docs()
    assert tuple(docs) == OFFLOAD_KEYS == tuple(f.name for f in dataclasses.fields(co.OffloadOptions))
    assert all(len(text) > 20 and "|" not in text for text in docs.values())
    assert list(argument_docs()) == list(co.offload.__init__.__signature__.parameters)[1:]
    flat = " ".join(co.offload.__doc__.split())
    flat_options = " ".join(co.OffloadOptions.__doc__.split())
    for name, text in argument_docs().items():
        rst = re.sub(r"`([^`]+)`", r"``\1``", text)
        assert f"{name}: {rst}" in flat, name
        assert name == "keep_dedup" or f"{name}: {rst}" in flat_options, name
    spec = importlib.util.spec_from_file_location("option_docs", ROOT / "scripts" / "option_docs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = (ROOT / "docs" / "api.md").read_text()
    assert script.rewritten(text) == text, (
        "docs/api.md's options table is not current: run python scripts/option_docs.py"
    )
    assert script.table() in text


def test_one_version_number_the_changelogs():
    # The package, the CHANGELOG's newest section and the sdist the docs install agree: an
    # unreleased section is that version's .dev0.
    scope = {}
    exec((ROOT / "ckpt_offload" / "_version.py").read_text(), scope)
    version = scope["__version__"]
    top = re.search(r"^## (\d+\.\d+\.\d+)( \(unreleased\))?$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert top, "CHANGELOG.md has no '## X.Y.Z' section"
    assert version == top.group(1) + (".dev0" if top.group(2) else ""), (version, top.group(0))
    for path in (ROOT / "README.md", ROOT / "docs" / "install.md"):
        named = set(re.findall(r"ckpt_offload-([0-9][0-9a-z.]*[0-9a-z])\.tar\.gz", path.read_text()))
        assert named == {version}, f"{path.name} installs ckpt_offload-{named}.tar.gz, the package is {version}"


# --- docs/design.md's map of Notes ------------------------------------------------------------------

NOTE = re.compile(r"Note \[([^\]\n]+)\]")
NOTE_FOLDERS = ("csrc", "ckpt_offload", "benchmarks", "scripts")
NOTE_SUFFIXES = {".h", ".cpp", ".cu", ".cuh", ".py", ".sh"}


def notes_in_code() -> dict:
    """Note name -> the files (relative to the repository) that cite it."""
    found: dict = {}
    for folder in NOTE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in NOTE_SUFFIXES and path.is_file():
                for name in NOTE.findall(path.read_text(errors="replace")):
                    found.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
    return found


def design_map() -> dict:
    """Note name -> the files docs/design.md's map says it is written in."""
    rows = {}
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`Note ["):
            (name,) = NOTE.findall(cells[0])
            assert name not in rows, f"docs/design.md maps Note [{name}] twice"
            rows[name] = re.findall(r"`([\w./-]+/[\w./-]+)`", cells[1])
    return rows


def test_the_design_map_reader_reads_rows():
    rows = design_map()
    assert rows["Lock order"] == ["csrc/torch/packer.h", "csrc/core/host_pool.h"]
    assert "csrc/torch/runtime.h" in notes_in_code()["Stream ordering"]


def test_every_note_in_code_is_on_the_design_map_and_every_row_in_its_file():
    code, rows = notes_in_code(), design_map()
    assert sorted(set(code) - set(rows)) == [], "Notes cited in code without a row in docs/design.md's map"
    assert sorted(set(rows) - set(code)) == [], "rows of docs/design.md's map whose Note no code cites"
    for name, where in rows.items():
        assert where, f"docs/design.md: Note [{name}] names no file"
        for path in where:
            assert path in code[name], f"docs/design.md: Note [{name}] is not in {path} (it is in {sorted(code[name])})"
