"""Writes the argument table of ``co.offload`` in docs/api.md from the options' descriptions (the
string under each field of ``co.OffloadOptions``, and ``keep_dedup``'s in offloading.py).

    python scripts/option_docs.py          # rewrite the table in docs/api.md
    python scripts/option_docs.py --check  # exit 1 if it is not current (tests/package/test_docs.py checks the same)
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"
BEGIN = "<!-- the options table: made from co.OffloadOptions' fields by scripts/option_docs.py -->"
END = "<!-- end of the options table -->"


def table() -> str:
    from ckpt_offload._option_docs import markdown_table
    from ckpt_offload.offloading import argument_docs

    return markdown_table(argument_docs())


def rewritten(text: str) -> str:
    """``text`` (docs/api.md) with the table between the markers made anew."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?\n" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{API_MD}: no options table between {BEGIN!r} and {END!r}")
    return pattern.sub(lambda _: f"{BEGIN}\n{table()}\n{END}", text, count=1)


def main(argv) -> int:
    text = API_MD.read_text()
    new = rewritten(text)
    if "--check" in argv:
        if new != text:
            print(f"{API_MD} is not current: run python scripts/option_docs.py", file=sys.stderr)
            return 1
        return 0
    API_MD.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
