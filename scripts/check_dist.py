"""Checks what ckpt_offload's sdist and wheel hold (scripts/check_sdist.sh runs it in CI).

    python scripts/check_dist.py sdist dist/ckpt_offload-0.2.0.dev0.tar.gz
    python scripts/check_dist.py wheel dist/ckpt_offload-0.2.0.dev0-cp311-cp311-linux_x86_64.whl

sdist: every file git tracks (except .gitignore) is in it -- so a new header or test cannot be
left out -- and no build output (_C, objects, _build_config.py, build/). Without git (run from an
unpacked sdist) the tree's files stand in for git's list.

wheel: the compiled ckpt_offload/_C, every module of the package, py.typed, _build_config.py and
the LICENSE; nothing outside ckpt_offload/ and its .dist-info (no tests, no benchmarks); metadata
with the license, Requires-Python, Requires-Dist torch and the version of ckpt_offload/_version.py.

Prints every problem and exits 1 when there is one.
"""

from __future__ import annotations

import email
import fnmatch
import os
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_SHIPPED = {".gitignore"}
BUILD_OUTPUTS = ["*.so", "*.o", "*.pyc", "*/__pycache__/*", "ckpt_offload/_build_config.py", "build/*", ".venv/*"]


def version() -> str:
    scope: dict = {}
    with open(os.path.join(ROOT, "ckpt_offload", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


def source_files() -> list[str]:
    """The repository's files, relative to ROOT: git's list, or the tree's without build outputs."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files"], capture_output=True, text=True, check=True).stdout
        files = out.split()
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in (".git", "build", ".venv") and not d.startswith("build-")]
            files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames]
        files = [f for f in files if not is_build_output(f) and not f.endswith(".egg-info") and "egg-info" not in f]
        files = [f for f in files if f != "PKG-INFO" and f != "setup.cfg"]  # written by sdist itself
    return sorted(f for f in files if f not in NOT_SHIPPED)


def is_build_output(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in BUILD_OUTPUTS)


def check_sdist(path: str) -> list[str]:
    prefix = f"ckpt_offload-{version()}/"
    with tarfile.open(path) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    problems = [f"{n}: outside {prefix}" for n in names if not n.startswith(prefix)]
    inside = {n[len(prefix) :] for n in names if n.startswith(prefix)}
    missing = [f for f in source_files() if f not in inside]
    problems += [f"{f}: in the repository but not in the sdist (MANIFEST.in)" for f in missing]
    problems += [f"{n}: a build output in the sdist" for n in sorted(inside) if is_build_output(n)]
    if "PKG-INFO" not in inside:
        problems.append("PKG-INFO: missing")
    if not problems:
        print(f"check_dist: sdist {os.path.basename(path)}: {len(inside)} files, every tracked file, no build output")
    return problems


def check_wheel(path: str) -> list[str]:
    ver = version()
    dist_info = f"ckpt_offload-{ver}.dist-info/"
    with zipfile.ZipFile(path) as whl:
        names = whl.namelist()
        has_metadata = dist_info + "METADATA" in names
        metadata = email.message_from_bytes(whl.read(dist_info + "METADATA")) if has_metadata else None
    problems = [
        f"{n}: not part of the package (tests, benchmarks and scripts stay in the sdist)"
        for n in names
        if not (n.startswith("ckpt_offload/") or n.startswith(dist_info))
    ]
    problems += [
        f"{n}: a test or benchmark file in the wheel" for n in names if {"tests", "benchmarks"} & set(n.split("/"))
    ]
    if not any(fnmatch.fnmatch(n, "ckpt_offload/_C.*.so") for n in names):
        problems.append("ckpt_offload/_C.*.so: the compiled extension is missing")
    modules = [f for f in source_files() if f.startswith("ckpt_offload/")]
    expected = modules + ["ckpt_offload/py.typed", "ckpt_offload/_build_config.py", "ckpt_offload/_version.py"]
    problems += [f"{f}: missing from the wheel" for f in sorted(set(expected)) if f not in names]
    if not any(n.startswith(dist_info) and os.path.basename(n) == "LICENSE" for n in names):
        problems.append(f"{dist_info}.../LICENSE: missing")
    if metadata is None:
        problems.append(f"{dist_info}METADATA: missing")
    else:
        license_field = metadata.get("License-Expression") or metadata.get("License")
        wanted = {
            "Version": (metadata.get("Version"), ver),
            "License-Expression": (license_field, "BSD-3-Clause"),
            "Requires-Python": (metadata.get("Requires-Python"), ">=3.11"),
        }
        problems += [f"METADATA {k}: {got!r}, expected {want!r}" for k, (got, want) in wanted.items() if got != want]
        requires = metadata.get_all("Requires-Dist") or []
        if not any(r.replace(" ", "").startswith("torch>=") for r in requires):
            problems.append(f"METADATA Requires-Dist: no torch>= requirement in {requires}")
        if "# ckpt_offload" not in (metadata.get_payload() or ""):
            problems.append("METADATA: the long description is not the README")
    if not problems:
        print(f"check_dist: wheel {os.path.basename(path)}: {len(names)} files, _C, the package, py.typed, metadata")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("sdist", "wheel"):
        print("usage: python scripts/check_dist.py sdist|wheel PATH", file=sys.stderr)
        return 2
    kind, path = argv
    problems = check_sdist(path) if kind == "sdist" else check_wheel(path)
    for p in problems:
        print(f"check_dist: {kind} {os.path.basename(path)}: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
