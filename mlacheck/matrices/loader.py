"""Named matrices (smoke, premerge, nightly, full) as YAML data, expanded into cases.

A matrix file is data, not code, so a kernel engineer can add a row without reading Python,
and every case it yields is a validated, seeded `mlacheck.spec` case with its pytest markers.

Schema (every key is checked: an unknown key, a bad value or a YAML error is a MatrixError
naming the file and the problem in one line):

    name: premerge                      # must match the file name (without .yaml)
    description: one line               # what the matrix is for
    include: [smoke]                    # optional: matrices whose cases come first (a file
                                        # next to this one, else a packaged matrix)
    shared: {...}                       # optional, ignored: a place to define YAML anchors
    groups:
      - name: decode-page-sizes         # unique in the file; shown in errors and reports
        kind: prefill | decode | sparse # PrefillCase | DecodeCase | SparseDecodeCase, or a
                                        # DeepSeek-V3.2 sparse-path kind: indexer,
                                        # indexer_paged, topk, index_conversion,
                                        # sparse_prefill, sparse_pipeline (spec.py)
        covers: [6, 11]                 # optional: bug classes (mlacheck/bugclasses.py) the group targets
        base: {field: value, ...}       # fields shared by every case of the group
        axes: {field: [v1, v2], ...}    # cartesian product over the listed values
        seeds: [0, 1]                   # optional: sugar for an axis over `seed`
        markers: [slow, gpu]            # optional: extra pytest markers for every case
        exclude:                        # optional: drop combinations matching ALL keys of a rule
          - {paging.layout: vectorized, paging.page_size: 1}

A group may instead be a covering array (mlacheck/coverage.py) over its op's factors:

      - name: decode-pairwise
        kind: decode
        covering: {strength: 2}         # every feasible pair of factor levels in some case;
                                        # optional op (prefill: mla_prefill or paged_prefill)
                                        # and seed (another, equally covering, construction)
        base: {...}                     # fields under the realised ones (optional)
        seeds: [0]                      # optional; `axes` and `exclude` do not combine with it

Fields are those of the case dataclass of `kind` (spec.py; spec.case_from_dict checks every
field's type). The batch is required, in base or an axis: `segments` (prefill) or `requests`
(decode, sparse); a covering group's rows realise it. Every problem of a file is reported in one
error. Nested fields are mappings:
`quant: {q: fp8_e4m3fn, kv: fp8_e4m3fn, scale: unit}`, `placement: {kind: high, offset_bytes:
4294967296}`, `paging: {page_size: 16, layout: vectorized}`, `dims: {rope_factor: 1.0}`.
An axis key may be a field (`num_heads`) or a dotted path into a nested field
(`paging.page_size`); a mapping given as an axis value is merged over the base's mapping.
Exclude rules use the same keys; a key the combination leaves unset compares as the
dataclass default, and a rule that matches nothing is an error (it is surely a typo).

`segments` (prefill) is a list of `[q_len, context_len]` pairs and `requests` (decode,
sparse) a list of `[q_len, kv_len]` pairs. A long batch can be written as a generator:

    requests: {repeat: 64, q_len: 1, kv_len: [100, 4000]}
    segments: {repeat: 8, q_len: [1024, 3072], context_len: 0}

meaning `repeat` entries whose lengths are an int (all equal) or `[lo, hi]`: evenly spaced
from lo to hi, then interleaved short/long (lo, hi, lo+d, hi-d, ...) so neighbouring
requests differ (the mixed batches persistent schedulers must balance).

Every case gets markers derived from its content (`derived_markers`) plus the group's.
Cases with the same id (e.g. one produced by two groups) are kept once (the first; markers
merged) and counted in `Matrix.duplicates_removed`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mlacheck import boundaries, bugclasses, coverage
from mlacheck.markers import KNOWN_MARKERS
from mlacheck.spec import (
    CASE_TYPES,
    PIPELINE_OPS,
    REQUIRED,
    Case,
    MLADims,
    Op,
    Paging,
    Placement,
    Quant,
    case_from_dict,
)

# Packaged matrices, smallest first: the order `names()` lists them in.
CANONICAL_ORDER = ("smoke", "premerge", "nightly", "full")

# What a group's `covers:` entries may name: a class of the one catalogue,
# mlacheck/bugclasses.py (a bug class by its number, a boundary class by its name).

GROUP_KEYS = ("name", "kind", "covers", "base", "axes", "seeds", "markers", "exclude",
              "covering")
COVERING_KEYS = ("strength", "op", "seed")
# The ops a covering group of each kind may build (the first unless it names another).
_COVERING_OPS = {"decode": (coverage.DECODE,), "sparse": (coverage.SPARSE,),
                 "prefill": (coverage.PREFILL, coverage.PAGED)}
TOP_KEYS = ("name", "description", "include", "shared", "groups")

_NESTED_TYPES: dict[str, type] = {
    "quant": Quant, "placement": Placement, "paging": Paging, "dims": MLADims,
}
_SEQUENCE_FIELDS = {"segments": ("q_len", "context_len"), "requests": ("q_len", "kv_len")}
_GENERATOR_KEYS = {"segments": ("repeat", "q_len", "context_len"),
                   "requests": ("repeat", "q_len", "kv_len")}


class MatrixError(ValueError):
    """A malformed matrix file: one line naming the file and the problem."""


@dataclass(frozen=True)
class MatrixCase:
    """One case of a matrix and the pytest markers it carries."""

    case: Case
    markers: tuple[str, ...]
    group: str = ""

    @property
    def id(self) -> str:
        return self.case.id


@dataclass(frozen=True)
class Matrix:
    """A loaded matrix: its cases in file order (includes first), duplicates removed."""

    name: str
    description: str
    cases: list[MatrixCase]
    path: str = ""
    duplicates_removed: int = 0

    def __len__(self) -> int:
        return len(self.cases)


def derived_markers(case: Case) -> tuple[str, ...]:
    """Markers that follow from a case's content, so `-m` selections never depend on a
    matrix author remembering them."""
    found: set[str] = set()
    if case.quant.is_fp8:
        found.add("fp8")
    if case.op in PIPELINE_OPS:  # the V3.2 sparse path: persistent only where it decodes
        found.add("sparse")
        if case.op == Op.SPARSE_PIPELINE:
            found.add("persistent")
        if len(case.units) > 1 and case.unit_name == "segment":
            found.add("multiseg")
        if case.placement.kind == "high":
            found.add("large_kv")
        return tuple(sorted(found))
    if case.op == Op.SPARSE_DECODE:
        found.add("sparse")
    if case.op in (Op.DECODE, Op.SPARSE_DECODE):  # persistent decode, on backends that have it
        found.add("persistent")
    elif len(case.units) > 1:
        found.add("multiseg")
    # Paged prefill and every decode use the pool; an unpaged prefill ignores placement.
    if case.placement.kind == "high" and case.paging is not None:
        found.add("large_kv")
    return tuple(sorted(found))


# --------------------------------------------------------------------------- public API


def names() -> list[str]:
    """Names of the packaged matrices, smallest first."""
    found = {p.name.rsplit(".", 1)[0] for p in _package_dir().iterdir()
             if p.name.endswith((".yaml", ".yml"))}
    known = [n for n in CANONICAL_ORDER if n in found]
    return known + sorted(found - set(known))


def load(name_or_path: str, seed: int | None = None) -> Matrix:
    """A packaged matrix by name, or a file when the argument ends in .yaml/.yml.

    With `seed`, every case's seed becomes its own seed + `seed` (the same matrix under
    many seeds, e.g. for false-alarm runs).
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise MatrixError(f"seed must be an int >= 0, got {seed!r}")
    path = _resolve(name_or_path)
    cases, description, name = _load_file_cached(path)
    kept: dict[str, MatrixCase] = {}
    for mc in cases:
        case = mc.case if not seed else dataclasses.replace(mc.case, seed=mc.case.seed + seed)
        mc = MatrixCase(case, mc.markers, mc.group)
        first = kept.get(mc.id)
        if first is None:
            kept[mc.id] = mc
        else:
            merged = tuple(sorted(set(first.markers) | set(mc.markers)))
            kept[mc.id] = MatrixCase(first.case, merged, first.group)
    return Matrix(name, description, list(kept.values()), str(path), len(cases) - len(kept))


# --------------------------------------------------------------------------- files


def _package_dir() -> Path:
    return Path(str(resources.files("mlacheck.matrices")))


def _resolve(name_or_path: str) -> Path:
    if name_or_path.endswith((".yaml", ".yml")):
        path = Path(name_or_path)
        if not path.is_file():
            raise MatrixError(f"{name_or_path}: no such matrix file")
        return path
    for ext in (".yaml", ".yml"):
        path = _package_dir() / f"{name_or_path}{ext}"
        if path.is_file():
            return path
    raise MatrixError(
        f"unknown matrix {name_or_path!r}; known: {', '.join(names())} (or give a .yaml path)"
    )


def _resolve_include(name: str, including: Path) -> Path:
    """An included matrix: a file next to the including one first, else a packaged one."""
    for ext in (".yaml", ".yml"):
        sibling = including.parent / f"{name}{ext}"
        if sibling.is_file():
            return sibling
    return _resolve(name)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (PyYAML silently keeps the last one,
    which would drop an axis without a word)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)  # resolve `<<: *anchor` merges first
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {line})", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise MatrixError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise MatrixError(f"{path}: YAML syntax error at {where}{problem}".replace("\n", " ")) \
            from None


# Files read per top-level load, with their contents' digests: a process loads the same
# matrix more than once (the CLI, then the pytest plugin in the same process), and the
# nightly's expansion costs seconds (2-4 s of each run's start); a file that changed on disk
# since is read again (contents, not mtimes: a test rewrites a file within one clock tick).
_LOADED: dict[Path, tuple[tuple[tuple[Path, str | None], ...], tuple[list[MatrixCase], str, str]]]
_LOADED = {}


def _stamp(path: Path) -> tuple[Path, str | None]:
    try:
        return path, hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return path, None


def _load_file_cached(path: Path) -> tuple[list[MatrixCase], str, str]:
    key = path.resolve()
    hit = _LOADED.get(key)
    if hit is not None and all(_stamp(p) == (p, digest) for p, digest in hit[0]):
        cases, description, name = hit[1]
        return list(cases), description, name
    read: list[Path] = []
    loaded = _load_file(path, (), read)
    _LOADED[key] = (tuple(map(_stamp, read)), loaded)
    return list(loaded[0]), loaded[1], loaded[2]


def export_expansions(path: Path) -> None:
    """This process's expanded matrix files, for its xdist workers (mlacheck.pytest_plugin):
    each worker expanded the matrix again before it could collect (the nightly: 1.0 s of a
    worker's ~5 s start on 2 cores, every worker; unpickled: 0.04 s)."""
    with open(path, "wb") as f:
        pickle.dump(_LOADED, f, protocol=pickle.HIGHEST_PROTOCOL)


def adopt_expansions(path: Path) -> None:
    """Another process's expansions (export_expansions), each used only while its files'
    contents are what they were (the check a second load in one process makes): a stale or
    unreadable file costs the time it saved, never a wrong case."""
    try:
        with open(path, "rb") as f:
            found = pickle.load(f)  # noqa: S301 - written by this run's own controller
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return
    if isinstance(found, dict):
        for key, entry in found.items():
            _LOADED.setdefault(key, entry)


def _load_file(path: Path, stack: tuple[str, ...], read: list[Path]
               ) -> tuple[list[MatrixCase], str, str]:
    """`read` gets every file read (this one and its includes)."""
    read.append(path)
    doc = _read_yaml(path)
    where = str(path)
    if not isinstance(doc, dict):
        raise MatrixError(f"{where}: a matrix file is a mapping with name, description, groups")
    _unknown(doc, TOP_KEYS, where, "top-level key")
    for key in ("name", "description", "groups"):
        if key not in doc:
            raise MatrixError(f"{where}: missing top-level key {key!r}")
    name, description = doc["name"], doc["description"]
    if not isinstance(name, str) or not isinstance(description, str):
        raise MatrixError(f"{where}: name and description must be strings")
    stem = path.name.rsplit(".", 1)[0]
    if name != stem:
        raise MatrixError(f"{where}: name {name!r} does not match the file name {stem!r}")
    cases: list[MatrixCase] = []
    for inc in _str_list(doc.get("include", []), where, "include"):
        if inc in stack or inc == name:
            raise MatrixError(f"{where}: include cycle: {' -> '.join((*stack, name, inc))}")
        cases += _load_file(_resolve_include(inc, path), (*stack, name), read)[0]
    groups = doc["groups"]
    if not isinstance(groups, list) or not groups:
        raise MatrixError(f"{where}: groups must be a non-empty list")
    seen_groups: set[str] = set()
    problems: list[str] = []
    for i, group in enumerate(groups):  # every group's problems, then one error
        try:
            cases += _expand_group(group, i, where, seen_groups)
        except MatrixError as e:
            problems.append(str(e))
    if problems:
        raise MatrixError(_all_problems(where, problems))
    return cases, description, name


# Problems of one group's combinations listed in full; more are counted.
MAX_COMBINATION_PROBLEMS = 8


def _all_problems(where: str, problems: list[str]) -> str:
    """Several problems of one file in one line: `file: 3 problems: group 'a': ...; ...`."""
    if len(problems) == 1:
        return problems[0]
    prefix = f"{where}: "
    parts = [p[len(prefix):] if p.startswith(prefix) else p for p in problems]
    return f"{where}: {len(parts)} problems: " + "; ".join(parts)


# --------------------------------------------------------------------------- groups


def _expand_group(group: Any, index: int, file: str, seen: set[str]) -> list[MatrixCase]:
    if not isinstance(group, dict):
        raise MatrixError(f"{file}: group {index} is not a mapping")
    gname = group.get("name")
    if not isinstance(gname, str) or not gname:
        raise MatrixError(f"{file}: group {index} needs a name")
    where = f"{file}: group {gname!r}"
    if gname in seen:
        raise MatrixError(f"{where}: duplicate group name")
    seen.add(gname)
    _unknown(group, GROUP_KEYS, where, "group key")
    kind = group.get("kind")
    if kind not in CASE_TYPES:
        raise MatrixError(f"{where}: kind must be one of {', '.join(CASE_TYPES)}, not {kind!r}")
    covers = group.get("covers", []) or []
    if not isinstance(covers, list):
        raise MatrixError(f"{where}: covers must be a list of classes, each "
                          f"{bugclasses.what_may_be_cited()}")
    for c in covers:
        if not bugclasses.is_class(c):
            raise MatrixError(f"{where}: covers {c!r} is neither "
                              f"{bugclasses.what_may_be_cited('nor')}")
    base = group.get("base", {}) or {}
    axes = dict(group.get("axes", {}) or {})
    if not isinstance(base, dict) or not isinstance(axes, dict):
        raise MatrixError(f"{where}: base and axes must be mappings")
    if "seeds" in group:
        if "seed" in axes:
            raise MatrixError(f"{where}: give seeds either as `seeds:` or as an axis, not both")
        axes["seed"] = group["seeds"]
    for key in base:
        _check_path(kind, str(key), where, "base field")
    for key, values in axes.items():
        _check_path(kind, str(key), where, "axis")
        if not isinstance(values, list) or not values:
            raise MatrixError(f"{where}: axis {key!r} must be a non-empty list of values")
    markers = tuple(_str_list(group.get("markers", []), where, "markers"))
    for m in markers:
        if m not in KNOWN_MARKERS:
            raise MatrixError(f"{where}: unknown marker {m!r}; known: {', '.join(KNOWN_MARKERS)}")
    rules = group.get("exclude", []) or []
    if not isinstance(rules, list) or not all(isinstance(r, dict) and r for r in rules):
        raise MatrixError(f"{where}: exclude must be a list of non-empty mappings")
    for rule in rules:
        for key in rule:
            _check_path(kind, str(key), where, "exclude key")

    if "covering" in group:  # the covering array realises the batch
        if set(axes) - {"seed"} or rules:
            raise MatrixError(f"{where}: a covering group takes no axes or exclude (only seeds)")
        combos = _covering_combos(group["covering"], kind, base, axes.get("seed"), where)
    else:
        lacking = [k for k in REQUIRED[kind] if k not in base and k not in axes]
        if lacking:
            raise MatrixError(f"{where}: missing required field(s) {', '.join(lacking)} (in base "
                              "or axes): a case's batch is never a silent default")
        combos = [(combo, _resolve_fields(base, combo)) for combo in _combinations(axes)]
    out: list[MatrixCase] = []
    bad: list[str] = []  # every combination's problem, then one error
    rule_hits = [0] * len(rules)
    for combo, fields in combos:
        hit = [i for i, r in enumerate(rules) if _matches(kind, fields, r)]
        for i in hit:
            rule_hits[i] += 1
        if hit:
            continue
        label = "{" + ", ".join(f"{k}: {_short(v)}" for k, v in combo.items()) + "}"
        try:
            case = case_from_dict({"kind": kind, **_typed_fields(fields)})
        except (ValueError, TypeError) as e:
            bad.append(f"combination {label}: {e}".replace("\n", " "))
            continue
        claimed = [c for c in covers if isinstance(c, str)]
        lacking = [c for c in claimed if c not in boundaries.classes_of(case)]
        if lacking:  # a group must have the shapes it says it covers
            bad.append(f"combination {label} covers {', '.join(lacking)} in name only (its "
                       "case lacks the shape; see mlacheck/boundaries.py)")
            continue
        marks = tuple(sorted(set(derived_markers(case)) | set(markers)))
        out.append(MatrixCase(case, marks, gname))
    bad += [f"exclude rule {rules[i]} matches no combination"
            for i, n in enumerate(rule_hits) if n == 0]
    if bad:
        more = len(bad) - MAX_COMBINATION_PROBLEMS
        shown = bad[:MAX_COMBINATION_PROBLEMS] + ([f"... and {more} more"] if more > 0 else [])
        raise MatrixError(f"{where}: " + "; ".join(shown))
    if not out:
        raise MatrixError(f"{where}: every combination is excluded")
    return out


def _covering_combos(spec: Any, kind: str, base: Mapping[str, Any], seeds: list[Any] | None,
                     where: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(label, fields) for every row of the group's covering array (x seeds), realised by
    mlacheck.coverage and merged over the base."""
    if not isinstance(spec, dict):
        raise MatrixError(f"{where}: covering must be a mapping with strength (and optional "
                          "op, seed)")
    _unknown(spec, COVERING_KEYS, where, "covering key")
    strength, op = spec.get("strength"), spec.get("op", _COVERING_OPS[kind][0])
    seed = spec.get("seed", 0)
    if strength not in coverage.CANDIDATES or isinstance(seed, bool) or not isinstance(seed, int):
        raise MatrixError(f"{where}: covering strength must be one of "
                          f"{', '.join(map(str, coverage.CANDIDATES))} and seed an integer")
    if op not in _COVERING_OPS[kind]:
        raise MatrixError(f"{where}: covering op {op!r} is not an op of a {kind} case "
                          f"({', '.join(_COVERING_OPS[kind])})")
    out = []
    for i, realised in enumerate(coverage.covering_cases(op, strength, seed)):
        for s in seeds if seeds is not None else [None]:
            fields = _resolve_fields(base, realised)
            label = {"row": i, **({"seed": s} if s is not None else {})}
            if s is not None:
                fields["seed"] = s
            out.append((label, fields))
    return out


def _combinations(axes: dict[str, list[Any]]) -> Iterator[dict[str, Any]]:
    keys = list(axes)
    for values in itertools.product(*(axes[k] for k in keys)):
        yield dict(zip(keys, values, strict=True))


def _resolve_fields(base: Mapping[str, Any], combo: Mapping[str, Any]) -> dict[str, Any]:
    """Base overlaid with one combination: dotted keys and mapping values merge into mappings."""
    fields: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in combo.items():
        head, _, sub = key.partition(".")
        if sub:
            nested = fields.get(head)
            fields[head] = {**(nested if isinstance(nested, dict) else {}), sub: value}
        elif isinstance(value, dict) and isinstance(fields.get(head), dict):
            fields[head] = {**fields[head], **value}
        else:
            fields[head] = value
    return fields


def _matches(kind: str, fields: Mapping[str, Any], rule: Mapping[str, Any]) -> bool:
    return all(_lookup(kind, fields, str(k)) == v for k, v in rule.items())


def _lookup(kind: str, fields: Mapping[str, Any], key: str) -> Any:
    """A (dotted) field of a resolved combination, or the dataclass default when unset."""
    head, _, sub = key.partition(".")
    default = _field_defaults(CASE_TYPES[kind])[head]
    value = fields.get(head, default)
    if not sub:
        return value
    if value is None:  # an unset optional mapping (unpaged prefill): no sub-field matches
        return None
    if isinstance(value, dict) and sub in value:
        return value[sub]
    return _field_defaults(_NESTED_TYPES[head])[sub]


def _field_defaults(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _check_path(kind: str, key: str, where: str, what: str) -> None:
    head, _, sub = key.partition(".")
    known = _field_defaults(CASE_TYPES[kind])
    if head not in known:
        raise MatrixError(f"{where}: unknown {what} {key!r} for a {kind} case; "
                          f"known: {', '.join(sorted(known))}")
    if sub:
        nested = _NESTED_TYPES.get(head)
        if nested is None:
            raise MatrixError(f"{where}: {what} {key!r}: {head} has no sub-fields")
        if sub not in _field_defaults(nested):
            raise MatrixError(f"{where}: unknown {what} {key!r}; {head} has "
                              f"{', '.join(sorted(_field_defaults(nested)))}")


# --------------------------------------------------------------------------- values


def _typed_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Segment / request generators expanded into pairs; every field's type is checked by
    mlacheck.spec.case_from_dict, the one owner of what a case's fields must be."""
    return {k: _generate(k, v) if k in _SEQUENCE_FIELDS and isinstance(v, dict) else v
            for k, v in fields.items()}


def _generate(key: str, spec: Mapping[str, Any]) -> list[list[int]]:
    """`{repeat: n, q_len: a|[lo,hi], <len>: b|[lo,hi]}` -> n [q_len, len] pairs (module doc)."""
    allowed = _GENERATOR_KEYS[key]
    unknown = set(spec) - set(allowed)
    if unknown or set(allowed[:2]) - set(spec):
        raise ValueError(f"{key} generator takes {', '.join(allowed)} (repeat and q_len required)")
    n = spec["repeat"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{key} generator: repeat must be an int >= 1, got {_short(n)}")
    columns = [_spread(f"{key}.{name}", spec.get(name, 0), n) for name in allowed[1:]]
    return [list(pair) for pair in zip(*columns, strict=True)]


def _spread(name: str, value: Any, n: int) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * n
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in value)
            or value[0] > value[1]):
        raise ValueError(f"{name} must be an int or [lo, hi] with lo <= hi, got {_short(value)}")
    lo, hi = value
    # lo + i * (hi - lo) / (n - 1), rounded half up in integers (no banker's rounding)
    even = [lo + (2 * i * (hi - lo) + n - 1) // (2 * (n - 1)) for i in range(n)] if n > 1 else [lo]
    interleaved = []
    for i in range((n + 1) // 2):  # lo, hi, lo+d, hi-d, ...: neighbours differ in length
        interleaved.append(even[i])
        if n - 1 - i != i:
            interleaved.append(even[n - 1 - i])
    return interleaved


def _str_list(value: Any, where: str, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MatrixError(f"{where}: {what} must be a list of strings")
    return value


def _unknown(d: Mapping[Any, Any], allowed: tuple[str, ...], where: str, what: str) -> None:
    extra = [str(k) for k in d if k not in allowed]
    if extra:
        raise MatrixError(f"{where}: unknown {what}(s) {', '.join(extra)}; "
                          f"known: {', '.join(allowed)}")


def _short(value: Any, limit: int = 60) -> str:
    text = str(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
