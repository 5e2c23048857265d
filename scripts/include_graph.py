"""The C++ layers' include graph, by unit: a source with its header (x.cpp and x.h of one folder) is one
unit, and a unit stands on a floor above every unit it includes (floor 1: includes none of them).

    python scripts/include_graph.py                 # csrc/torch (its subfolders' units included)
    python scripts/include_graph.py csrc/core       # another folder

Prints each unit by floor, the number of floors (the include depth), every circle (units that
include each other: an include that runs back up) and the largest file. Exits 1 when there is a
circle. tests/package/test_layout.py checks csrc/torch has none.
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIXES = (".h", ".cpp", ".cu", ".cuh")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def unit_of(path: str) -> str:
    """x.cpp and x.h of one folder are one unit, named by its path without the suffix."""
    return os.path.splitext(path)[0]


def files(folders) -> list:
    """Every C++ file under the folders, relative to the repository root."""
    found = []
    for folder in folders:
        for base, _, names in os.walk(os.path.join(ROOT, folder)):
            found += [os.path.relpath(os.path.join(base, n), ROOT) for n in names if n.endswith(SUFFIXES)]
    return sorted(found)


def include_graph(folders=("csrc/torch",)) -> dict:
    """unit -> the units (among the folders' files) its files include, itself left out."""
    paths = files(folders)
    known = set(paths)
    graph = {unit_of(p): set() for p in paths}
    for p in paths:
        with open(os.path.join(ROOT, p)) as f:
            text = f.read()
        for target in _INCLUDE.findall(text):
            included = os.path.normpath(os.path.join(os.path.dirname(p), target))
            if included in known and unit_of(included) != unit_of(p):
                graph[unit_of(p)].add(unit_of(included))
    return graph


def circles(graph: dict) -> list:
    """The strongly connected groups of more than one unit (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floors(graph: dict) -> dict:
    """unit -> its floor: 1 + the highest floor it includes (1 when it includes none). Only for a
    graph without circles."""
    floor: dict = {}

    def of(v):
        if v not in floor:
            floor[v] = 1 + max((of(w) for w in graph[v]), default=0)
        return floor[v]

    for v in graph:
        of(v)
    return floor


def lines(path: str) -> int:
    with open(os.path.join(ROOT, path)) as f:
        return sum(1 for _ in f)


def main(argv) -> int:
    folders = argv or ["csrc/torch"]
    for folder in folders:
        graph = include_graph((folder,))
        found = circles(graph)
        print(f"== {folder}: {len(graph)} units")
        if found:
            for group in found:
                print("circle: " + " <-> ".join(group))
            continue
        floor = floors(graph)
        for level in range(max(floor.values()), 0, -1):
            names = sorted(os.path.relpath(u, folder) for u, f in floor.items() if f == level)
            print(f"floor {level:2d}  " + ", ".join(names))
        sizes = {p: lines(p) for p in files((folder,))}
        largest = max(sizes, key=sizes.get)
        print(f"{max(floor.values())} floors, no circle; largest file {largest} ({sizes[largest]} lines)")
    return 1 if any(circles(include_graph((f,))) for f in folders) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
