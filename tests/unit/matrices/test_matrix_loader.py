"""The matrix loader: schema semantics (product, dotted axes, merges, generators, exclude,
markers, seeds, include, duplicates) and one-line MatrixErrors for malformed files."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlacheck.matrices import MatrixError, derived_markers, load, names
from mlacheck.spec import (
    DecodeCase,
    Paging,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
    SparseDecodeCase,
)


def write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\ndescription: test\n" + textwrap.dedent(body))
    return path


def error_of(path: Path | str) -> str:
    with pytest.raises(MatrixError) as info:
        load(str(path))
    message = str(info.value)
    assert "\n" not in message, "a MatrixError is one line"
    return message


# --------------------------------------------------------------------------- packaged


def test_packaged_names_smallest_first() -> None:
    assert names()[:4] == ["smoke", "premerge", "nightly", "full"]


@pytest.mark.parametrize("name", ["smoke", "premerge", "nightly", "full"])
def test_packaged_matrices_load_with_unique_ids(name: str) -> None:
    m = load(name)
    assert m.name == name and m.description
    ids = [mc.id for mc in m.cases]
    assert len(ids) == len(set(ids)) and ids


def test_unknown_matrix_name_lists_known_ones() -> None:
    message = error_of("nosuch")
    assert "unknown matrix 'nosuch'" in message and "smoke" in message


def test_seed_offsets_every_case_seed() -> None:
    base, shifted = load("smoke"), load("smoke", seed=7)
    assert len(base.cases) == len(shifted.cases)
    for a, b in zip(base.cases, shifted.cases, strict=True):
        assert b.case.seed == a.case.seed + 7
        assert b.id != a.id and b.markers == a.markers
    with pytest.raises(MatrixError, match="seed must be an int >= 0"):
        load("smoke", seed=-1)


# --------------------------------------------------------------------------- semantics


def test_product_dotted_axes_and_exclude(tmp_path: Path) -> None:
    path = write(tmp_path, "m", """
        groups:
          - name: paged
            kind: prefill
            base: {segments: [[8, 4], [3, 0]], num_heads: 8}
            axes:
              paging.page_size: [1, 16]
              paging.layout: [linear, vectorized]
              causal: [true, false]
            exclude:
              - {paging.page_size: 1, paging.layout: vectorized}
    """)
    m = load(str(path))
    # 2 page sizes x 2 layouts x 2 causal, minus (1, vectorized) x 2 causal
    assert len(m.cases) == 6
    pagings = {mc.case.paging for mc in m.cases}
    assert pagings == {Paging(1, "linear"), Paging(16, "linear"), Paging(16, "vectorized")}
    first = m.cases[0].case
    assert first == PrefillCase(segments=(Segment(8, 4), Segment(3, 0)), num_heads=8,
                                paging=Paging(1, "linear"), causal=True)
    assert m.cases[0].markers == ("multiseg",) and m.cases[0].group == "paged"


def test_mapping_axis_values_merge_over_base(tmp_path: Path) -> None:
    path = write(tmp_path, "m", """
        groups:
          - name: g
            kind: decode
            base: {requests: [[1, 40]], quant: {q: fp8_e4m3fn, kv: fp8_e4m3fn, scale: unit}}
            axes:
              quant: [{scale: amax}, {q: fp8_e4m3fnuz, kv: fp8_e4m3fnuz}]
    """)
    quants = [mc.case.quant for mc in load(str(path)).cases]
    assert quants == [Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax"),
                      Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "unit")]


def test_request_generator_spreads_and_interleaves(tmp_path: Path) -> None:
    path = write(tmp_path, "m", """
        groups:
          - name: g
            kind: decode
            base: {requests: {repeat: 5, q_len: [1, 3], kv_len: [100, 500]}}
    """)
    (mc,) = load(str(path)).cases
    # evenly spaced (rounded half up): q 1, 2, 2, 3, 3 and kv 100, 200, 300, 400, 500,
    # then interleaved lo, hi, lo+d, hi-d, middle
    assert mc.case.requests == (Request(1, 100), Request(3, 500), Request(2, 200),
                                Request(3, 400), Request(2, 300))


def test_segment_generator_totals(tmp_path: Path) -> None:
    path = write(tmp_path, "m", """
        groups:
          - name: g
            kind: prefill
            base: {segments: {repeat: 8, q_len: [1024, 3072], context_len: 0}}
    """)
    (mc,) = load(str(path)).cases
    assert len(mc.case.segments) == 8 and mc.case.total_q == 16384
    assert all(s.context_len == 0 for s in mc.case.segments)


def test_markers_derived_and_explicit(tmp_path: Path) -> None:
    path = write(tmp_path, "m", """
        groups:
          - name: big
            kind: sparse
            markers: [slow]
            base:
              requests: [[1, 70]]
              topk: 64
              quant: {q: fp8_e4m3fnuz, kv: fp8_e4m3fnuz}
              placement: {kind: high, offset_bytes: 2147483648}
          - name: unpaged-high
            kind: prefill
            base: {segments: [[64, 0]], placement: {kind: high, offset_bytes: 2147483648}}
    """)
    sparse, unpaged = load(str(path)).cases
    assert sparse.markers == ("fp8", "large_kv", "persistent", "slow", "sparse")
    # an unpaged prefill has no pool: its placement is never used, so no large_kv
    assert unpaged.markers == ()


def test_derived_markers_follow_case_content() -> None:
    assert derived_markers(DecodeCase()) == ("persistent",)
    assert derived_markers(SparseDecodeCase()) == ("persistent", "sparse")
    assert derived_markers(PrefillCase(segments=(Segment(4), Segment(2, 1)))) == ("multiseg",)
    high = Placement("high", offset_bytes=1 << 32)
    assert "large_kv" in derived_markers(DecodeCase(placement=high))
    assert "large_kv" in derived_markers(PrefillCase(paging=Paging(), placement=high))


def test_seeds_duplicates_and_sibling_include(tmp_path: Path) -> None:
    write(tmp_path, "inner", """
        groups:
          - name: one
            kind: decode
            base: {requests: [[1, 10]], num_heads: 8}
    """)
    path = write(tmp_path, "outer", """
        include: [inner]
        groups:
          - name: seeded
            kind: decode
            base: {requests: [[1, 10]]}
            seeds: [0, 1, 2]
          - name: again
            kind: decode
            markers: [gpu]
            base: {requests: [[1, 10]], seed: 1}
    """)
    m = load(str(path))
    assert m.cases[0].group == "one" and m.cases[0].case.num_heads == 8
    assert [mc.case.seed for mc in m.cases[1:]] == [0, 1, 2]
    assert m.duplicates_removed == 1
    # the duplicate is dropped, its markers are merged into the first occurrence
    assert m.cases[2].group == "seeded" and "gpu" in m.cases[2].markers
    assert m.path == str(path)


def test_include_cycle_is_an_error(tmp_path: Path) -> None:
    group = "groups: [{name: g, kind: decode, base: {requests: [[1, 9]]}}]\n"
    write(tmp_path, "a", "include: [b]\n" + group)
    path = write(tmp_path, "b", "include: [a]\n" + group)
    assert "include cycle: b -> a -> b" in error_of(path)


def test_include_of_packaged_matrix_comes_first(tmp_path: Path) -> None:
    path = write(tmp_path, "plus", """
        include: [smoke]
        groups:
          - name: extra
            kind: decode
            base: {requests: [[1, 11]]}
    """)
    m, smoke = load(str(path)), load("smoke")
    assert [mc.id for mc in m.cases[: len(smoke.cases)]] == [mc.id for mc in smoke.cases]
    assert len(m.cases) == len(smoke.cases) + 1


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("groups:\n  - name: g\n    kind: decode\n    base: {num_head: 16}\n",
         "unknown base field 'num_head' for a decode case"),
        ("groups:\n  - name: g\n    kind: decode\n    axes: {placement.offset: [1]}\n",
         "unknown axis 'placement.offset'"),
        ("groups:\n  - name: g\n    kind: decode\n    base: {requests: [[1, 9]], num_heads: 16x}\n",
         "num_heads must be an integer, got '16x' (a string)"),
        ("groups:\n  - name: g\n    kind: decode\n    base: {requests: [[1, 9]], quant: {q: fp9}}\n",
         "unknown format 'fp9'"),
        ("groups:\n  - name: g\n    kind: decode\n    base: {num_heads: 16}\n",
         "group 'g': missing required field(s) requests (in base or axes)"),
        ("groups:\n  - name: g\n    kind: decode\n    base: {requests: [[5, 2]]}\n",
         "need 0 <= q_len <= kv_len"),
        ("groups:\n  - name: g\n    kind: decoder\n", "kind must be one of"),
        ("groups:\n  - name: g\n    kind: decode\n    markers: [slwo]\n", "unknown marker 'slwo'"),
        ("groups:\n  - name: g\n    kind: decode\n    covers: [99]\n", "neither a bug class of mlacheck/bugclasses.py"),
        ("groups:\n  - name: g\n    kind: decode\n    covers: 3\n", "covers must be a list"),
        ("groups:\n  - name: g\n    kind: decode\n    axes: {page_size: 16}\n",
         "axis 'page_size' must be a non-empty list"),
        ("groups:\n  - name: g\n    kind: decode\n    axes: {page_size: [16]}\n"
         "    base: {requests: [[1, 9]]}\n    exclude: [{page_size: 1}]\n",
         "matches no combination"),
        ("groups:\n  - name: g\n    kind: decode\n    base: {requests: {repeat: 2}}\n",
         "generator takes repeat, q_len, kv_len"),
        ("groups:\n  - name: g\n    kind: decode\n  - name: g\n    kind: decode\n",
         "duplicate group name"),
        ("grups: []\n", "unknown top-level key(s) grups"),
        ("groups:\n  - name: g\n    kind: decode\n    axis: {}\n", "unknown group key(s) axis"),
    ],
)
def test_malformed_files_raise_one_line_naming_file(tmp_path: Path, body: str,
                                                   expected: str) -> None:
    path = write(tmp_path, "bad", body)
    message = error_of(path)
    assert str(path) in message and expected in message


def test_impossible_combination_names_group_and_combination(tmp_path: Path) -> None:
    path = write(tmp_path, "bad", """
        groups:
          - name: paged
            kind: prefill
            base: {segments: [[9, 0]], quant: {q: bf16, kv: bf16}}
            axes:
              paging.page_size: [16, 4]
              paging.layout: [vectorized]
    """)
    message = error_of(path)
    assert "group 'paged'" in message
    assert "combination {paging.page_size: 4, paging.layout: vectorized}" in message
    assert "vectorized layout needs page_size % 8 == 0" in message


def test_yaml_syntax_error_has_line_number(tmp_path: Path) -> None:
    path = write(tmp_path, "bad", "groups:\n  - name: g\n    kind: [decode\n")
    message = error_of(path)
    assert "YAML syntax error at line" in message


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "bad", """
        groups:
          - name: g
            kind: decode
            axes: {page_size: [1]}
            axes: {num_heads: [8]}
    """)
    assert "duplicate key 'axes'" in error_of(path)


def test_name_must_match_file(tmp_path: Path) -> None:
    path = tmp_path / "file.yaml"
    path.write_text("name: other\ndescription: x\ngroups: []\n")
    assert "does not match the file name 'file'" in error_of(path)


def test_missing_file(tmp_path: Path) -> None:
    assert "no such matrix file" in error_of(tmp_path / "absent.yaml")


def test_every_problem_of_a_file_in_one_message(tmp_path: Path) -> None:
    """Issue 33: a matrix's errors came one per run. Every group's problem and every bad
    combination of a group are named in one (one-line) error."""
    path = write(tmp_path, "bad", """
        groups:
          - name: typo
            kind: decode
            base: {requests: [[1, 9]], num_heads: 16x}
          - name: no-batch
            kind: prefill
            base: {num_heads: 16}
          - name: fine
            kind: decode
            base: {requests: [[1, 9]]}
          - name: two-bad-lengths
            kind: decode
            axes:
              requests: [[[1, "37"]], [[1, 40]], [[2, 1]]]
    """)
    message = error_of(path)
    assert message.startswith(f"{path}: 3 problems: group 'typo': "), message
    assert "num_heads must be an integer, got '16x' (a string)" in message
    assert "group 'no-batch': missing required field(s) segments" in message
    assert "group 'fine'" not in message
    assert "requests[0].kv_len must be an integer, got '37' (a string)" in message
    assert "need 0 <= q_len <= kv_len" in message  # the third combination, same group


# --------------------------------------------------------------------------- covering groups


def test_a_covering_group_is_its_ops_covering_array(tmp_path: Path) -> None:
    from mlacheck import coverage

    path = write(tmp_path, "m", """
        groups:
          - name: pw
            kind: prefill
            covering: {strength: 2, op: paged_prefill}
            base: {seed: 0}
            seeds: [0, 5]
    """)
    cases = [mc.case for mc in load(str(path)).cases]
    rows = coverage.covering_array(coverage.PAGED, 2)
    assert len(cases) == 2 * len(rows)
    assert {c.seed for c in cases} == {0, 5}
    assert all(c.op == coverage.PAGED for c in cases)
    assert not coverage.uncovered(cases, coverage.PAGED, 2)


@pytest.mark.parametrize("covering, extra, message", [
    ("{strength: 4}", "", "strength must be one of 2, 3"),
    ("{strength: 2, op: mla_decode}", "", "is not an op of a prefill case"),
    ("{strength: 2, width: 3}", "", "unknown covering key"),
    ("2", "", "covering must be a mapping"),
    ("{strength: 2}", "axes: {num_heads: [8, 16]}", "takes no axes or exclude"),
])
def test_covering_group_errors(tmp_path: Path, covering: str, extra: str, message: str) -> None:
    path = write(tmp_path, "m", f"""
        groups:
          - name: pw
            kind: prefill
            covering: {covering}
            {extra}
    """)
    assert message in error_of(path)


# --------------------------------------------------------------------------- reuse in a process


def _including_pair(tmp_path: Path) -> tuple[Path, Path]:
    """`top` (one prefill case of 32 tokens) includes `base` (one of 64)."""
    base = write(tmp_path, "base", """
        groups:
          - name: g
            kind: prefill
            base: {segments: [[64, 0]], num_heads: 8}
    """)
    top = write(tmp_path, "top", """
        include: [base]
        groups:
          - name: t
            kind: prefill
            base: {segments: [[32, 0]], num_heads: 8}
    """)
    return base, top


def test_a_reloaded_file_is_read_again_when_it_or_an_include_changed(tmp_path: Path) -> None:
    """A process loads a matrix more than once (CLI, then the pytest plugin) and reuses the
    expansion; an edit of the file or of one it includes — even to the same size within one
    clock tick — must be seen."""
    base, top = _including_pair(tmp_path)
    first = load(str(top))
    again = load(str(top))
    assert [mc.id for mc in again.cases] == [mc.id for mc in first.cases]
    again.cases.clear()  # a caller's list is its own
    assert len(load(str(top)).cases) == 2
    base.write_text(base.read_text().replace("[[64, 0]]", "[[96, 0]]"))  # same size
    assert {mc.case.segments[0].q_len for mc in load(str(top)).cases} == {96, 32}
    top.write_text(top.read_text().replace("[[32, 0]]", "[[48, 0]]"))
    assert {mc.case.segments[0].q_len for mc in load(str(top)).cases} == {96, 48}


def test_a_worker_adopts_the_controllers_expansion_only_while_its_files_are_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """xdist workers take the controller's expanded matrix instead of expanding it again; an
    edited file (or an include) is expanded anew, and an unreadable export is ignored."""
    from mlacheck.matrices import loader

    base, top = _including_pair(tmp_path)
    ids = [mc.id for mc in load(str(top)).cases]
    export = tmp_path / "expanded.pickle"
    loader.export_expansions(export)
    monkeypatch.setattr(loader, "_LOADED", {})  # a fresh worker process
    expanded = []
    plain = loader._load_file
    monkeypatch.setattr(loader, "_load_file", lambda *a: expanded.append(a[0]) or plain(*a))
    loader.adopt_expansions(export)
    assert [mc.id for mc in load(str(top)).cases] == ids and expanded == []
    base.write_text(base.read_text().replace("[[64, 0]]", "[[96, 0]]"))  # an include changed
    assert {mc.case.segments[0].q_len for mc in load(str(top)).cases} == {96, 32}
    assert expanded.count(top) == 1
    monkeypatch.setattr(loader, "_LOADED", {})
    export.write_bytes(b"not a pickle")
    loader.adopt_expansions(export)
    loader.adopt_expansions(tmp_path / "missing.pickle")
    assert {mc.case.segments[0].q_len for mc in load(str(top)).cases} == {96, 32}
    assert expanded.count(top) == 2


def test_a_case_id_is_computed_once_and_replace_gives_the_new_one() -> None:
    case = PrefillCase(segments=(Segment(8, 4),), num_heads=8)
    assert case.id == case.id and case.identity_json() is case.identity_json()
    other = dataclasses.replace(case, num_heads=16)
    assert other.id != case.id
    assert other.id == PrefillCase(segments=(Segment(8, 4),), num_heads=16).id
    assert case == PrefillCase(segments=(Segment(8, 4),), num_heads=8)  # the cache is no field
    assert "_identity_json_cache" not in dataclasses.asdict(case)


def test_expanding_a_matrix_imports_no_torch() -> None:
    """`mlacheck run` expands the matrix before its workers start; torch there (2-3 s on a
    GPU host) was on the critical path of every run (issue 27). The page-boundary classes
    need the pool's page count, which the placement computes without tensors."""
    code = ("import sys\nfrom mlacheck.matrices import load\nm = load('premerge')\n"
            "assert any(mc.case.paging is not None for mc in m.cases)\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"
