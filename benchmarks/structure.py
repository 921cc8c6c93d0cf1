"""The package's shape in numbers: modules, lines, import arrows, and the counts issue 31
tracks (status tests outside mlacheck/verdict.py, isinstance branches on case kind).

    python3 benchmarks/structure.py                 # this checkout
    python3 benchmarks/structure.py --root /work/main --json before.json
    python3 benchmarks/structure.py --arrows        # every arrow, one per line

An import arrow is one (importer, imported) pair of mlacheck modules, lazy imports inside
functions included (they are dependencies all the same). "Nodes" counts mlacheck's
top-level modules and subpackages (mlacheck.backends is one node), the granularity the
structure drawing uses; "files" counts every module. Vendored code
(mlacheck/backends/aiter_model/jit) is left out. Pure standard library: no mlacheck import.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

VENDORED = ("mlacheck/backends/aiter_model/jit",)
# A status's meaning written out: `status in (FAIL, CRASH)`, `not in (PASS, SKIP)`, or the
# old copies `is_known(` / `is_xpass(` (what mlacheck/verdict.py owns).
STATUS_TUPLE = re.compile(r"""\bin\s*\(\s*["']?(PASS|FAIL|CRASH|SKIP|ERROR)\b|\b(is_known|is_xpass)\(""")
# One status compared: `v.status == CRASH` (a crash's traceback, ...): counted, not a copy.
STATUS_EQ = re.compile(r"""status\s*(==|!=)\s*["']?(PASS|FAIL|CRASH|SKIP|ERROR)\b""")
# A branch on the kind of case: isinstance(x, DecodeCase / PrefillCase / SparseDecodeCase ...)
CASE_KINDS = re.compile(r"isinstance\([^()]*(\([^()]*\))?[^()]*\b(Decode|Prefill|SparseDecode|"
                        r"PagedPrefill)Case\b")


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for p in sorted((root / "mlacheck").rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(VENDORED):
            continue
        name = rel[:-3].replace("/", ".")
        out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The mlacheck modules `name` imports (lazy imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from mlacheck import fp8`: the submodule when there is one, else the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def node_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2])


def measure(root: Path) -> dict[str, object]:
    mods = modules(root)
    known = set(mods)
    arrows = {(a, b) for a, p in mods.items() for b in imports(a, p, known)}
    nodes = {node_of(m) for m in mods}
    node_arrows = {(node_of(a), node_of(b)) for a, b in arrows if node_of(a) != node_of(b)}
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in mods.items()}
    out_of_backends = sorted(b for a, b in node_arrows if a == "mlacheck.backends")
    above = _importers_of(node_arrows, "mlacheck.backends")
    status_tests, status_eq, kinds, asserts = [], [], [], 0
    for m, p in mods.items():
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#")[0]
            if m != "mlacheck.verdict" and STATUS_TUPLE.search(code):
                status_tests.append(f"{p.relative_to(root)}:{i}")
            if m != "mlacheck.verdict" and STATUS_EQ.search(code):
                status_eq.append(f"{p.relative_to(root)}:{i}")
            found = len(CASE_KINDS.findall(line))
            kinds += [f"{p.relative_to(root)}:{i}"] * found
            asserts += found if line.strip().startswith("assert ") else 0
    return {
        "files": len(mods), "lines": sum(lines.values()), "nodes": len(nodes),
        "file_arrows": len(arrows), "node_arrows": len(node_arrows),
        "arrows_out_of_backends": out_of_backends,
        "upward_out_of_backends": sorted(set(out_of_backends) & above),
        "status_tests_outside_verdict": status_tests, "single_status_comparisons": status_eq,
        "isinstance_case_kind": len(kinds), "isinstance_case_kind_asserts": asserts,
        "isinstance_case_kind_files": len({k.rsplit(":", 1)[0] for k in kinds}),
        "sizes": dict(sorted(lines.items())),
        "_arrows": sorted(arrows),
    }


def _importers_of(arrows: set[tuple[str, str]], target: str) -> set[str]:
    """Nodes that import `target`, directly or through others: the layers above it."""
    above, frontier = set(), {target}
    while frontier:
        frontier = {a for a, b in arrows if b in frontier and a not in above and a != target}
        above |= frontier
    return above


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--arrows", action="store_true", help="print every file-level arrow")
    ap.add_argument("--sizes", nargs="*", default=None, metavar="MODULE",
                    help="print the line counts of these modules (all: no names)")
    args = ap.parse_args(argv)
    m = measure(Path(args.root))
    if args.arrows:
        for a, b in m["_arrows"]:
            print(f"{a} -> {b}")
        return 0
    print(f"modules: {m['files']} files, {m['nodes']} nodes, {m['lines']} lines")
    print(f"import arrows: {m['file_arrows']} between files, {m['node_arrows']} between nodes")
    print(f"arrows out of backends/: {', '.join(m['arrows_out_of_backends'])}")
    print(f"  upward (to a node that imports backends/): "
          f"{', '.join(m['upward_out_of_backends']) or 'none'}")
    st = m["status_tests_outside_verdict"]
    print(f"status tuple tests outside verdict.py: {len(st)}" + "".join(f"\n  {s}" for s in st))
    print(f"single-status comparisons outside verdict.py: {len(m['single_status_comparisons'])}")
    print(f"isinstance on case kind: {m['isinstance_case_kind']} in "
          f"{m['isinstance_case_kind_files']} files ({m['isinstance_case_kind_asserts']} of "
          "them type-narrowing asserts)")
    if args.sizes is not None:
        for name, n in m["sizes"].items():
            if not args.sizes or name in args.sizes or name.removeprefix("mlacheck.") in args.sizes:
                print(f"  {n:5d}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in m.items() if k != "_arrows"},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
