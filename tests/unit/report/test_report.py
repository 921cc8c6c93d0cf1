"""The report module: tolerant loading, counts, grouped skips, failures first, both reports,
self-contained HTML and the `mlacheck report` exit codes."""

from __future__ import annotations

import base64
import json
import re
import struct
import warnings
import zlib
from pathlib import Path

import pytest
from _report_synth import (
    CRASH_ID,
    FAIL_ID,
    HEADS_REASON,
    KNOWN_REASON,
    PAGE_REASON,
    failing,
    passing,
    run_verdicts,
    write_jsonl,
)

from mlacheck.backends.base import Capability, Output
from mlacheck.inputs import DecodeInputs
from mlacheck.outcome import KNOWN
from mlacheck.report import (
    load_results,
    main,
    render_html,
    render_markdown,
    summarise,
    write_html,
    write_markdown,
)
from mlacheck.report import plots as plots_mod
from mlacheck.report.load import parse_line, read_results
from mlacheck.spec import Case
from mlacheck.verdict import FAIL, PASS, SKIP, Verdict


@pytest.fixture
def results(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "results.jsonl", run_verdicts())


# --------------------------------------------------------------------------- loading


def test_load_skips_truncated_line_with_one_warning(results: Path) -> None:
    with pytest.warns(UserWarning, match=r"skipped 1 unparsable line\(s\) \(line 39\)"):
        vs = load_results(results)
    assert len(vs) == 38
    assert {v.case_id for v in vs} >= {FAIL_ID, CRASH_ID}


def test_load_round_trips_where_and_known(results: Path) -> None:
    vs = read_results(results).verdicts
    fail = next(v for v in vs if v.case_id == FAIL_ID)
    assert fail.where[0].bytes == (0x80000000, 0x80012000) and fail.where[0].tokens == (4, 7)
    assert fail.where[1].worst == float("inf")
    assert [getattr(v, "known_failure", "") for v in vs if v.status == FAIL] == ["", KNOWN_REASON]


@pytest.mark.parametrize(
    "line",
    [
        "",
        "{",
        "[1, 2]",
        "null",
        '{"case_id": "x"}',
        '{"case_id": "x", "backend": "b", "op": "o", "status": "PASS", "where": [{"check": 1}]}',
        '{"case_id": "x", "backend": "b", "op": "o", "status": "PASS", "metrics": [1]}',
    ],
)
def test_parse_line_rejects_malformed(line: str) -> None:
    assert parse_line(line) is None


def test_parse_line_ignores_unknown_keys() -> None:
    v = parse_line('{"case_id": "x", "backend": "b", "op": "o", "status": "PASS", "new": 1}')
    assert v is not None and v.status == PASS


def test_load_clean_file_warns_nothing(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "r.jsonl", [passing(0)], truncated=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_results(p)) == 1


# --------------------------------------------------------------------------- summary


def test_summary_counts_per_backend_op_status() -> None:
    s = summarise(run_verdicts(), unparsable=1)
    assert s.total == 38
    assert dict(s.by_status) == {PASS: 20, FAIL: 1, "CRASH": 1, SKIP: 15, KNOWN: 1}
    assert dict(s.counts[("aiter", "mla_decode")]) == {PASS: 15, FAIL: 1, SKIP: 12}
    assert dict(s.counts[("aiter", "mla_prefill")]) == {"CRASH": 1, KNOWN: 1, SKIP: 3}
    assert dict(s.counts[("torch", "mla_prefill")]) == {PASS: 5}
    assert s.total_line() == (
        "38 cases: 20 PASS, 1 FAIL, 1 CRASH, 15 SKIP, 1 KNOWN (1 unparsable line skipped)"
    )


def test_summary_groups_skip_reasons_biggest_first() -> None:
    s = summarise(run_verdicts())
    assert [g.line() for g in s.skips] == [
        f"aiter mla_decode: {PAGE_REASON}: 12 cases",
        f"aiter mla_prefill: {HEADS_REASON}: 3 cases",
    ]


def test_summary_failures_exclude_known_and_put_crashes_first() -> None:
    s = summarise(run_verdicts())
    assert [f.verdict.case_id for f in s.failures] == [FAIL_ID, CRASH_ID]  # backend/op order
    assert "pool bytes 0x80000000-0x80012000 (above 2^31)" in s.failures[0].text
    assert [f.verdict.status for f in s.known] == [FAIL]
    assert KNOWN_REASON in s.known[0].text


def test_summary_distributions_per_compute_format() -> None:
    s = summarise(run_verdicts())
    d = {x.fmt: x for x in s.distributions}
    assert set(d) == {"bf16", "fp8_e4m3fn"}
    assert d["bf16"].n == 15 and d["bf16"].over == 0
    assert d["fp8_e4m3fn"].n == 7  # 5 PASS + FAIL + KNOWN; the CRASH has no metrics
    assert d["fp8_e4m3fn"].over == 2
    assert d["fp8_e4m3fn"].quantile(1.0) == pytest.approx(0.9 / 0.0625)
    assert d["bf16"].quantile(0.5) == pytest.approx(0.2)


def test_summary_timings_per_phase() -> None:
    s = summarise(run_verdicts())
    t = {p.phase: p for p in s.timings}
    assert list(t) == ["inputs", "kernel", "golden", "baseline", "judge"]
    assert t["kernel"].total == pytest.approx(20 * 0.002 + 0.5)
    assert t["kernel"].worst_case == FAIL_ID
    assert t["inputs"].cases == 22


def test_stale_known_failure_is_flagged(tmp_path: Path) -> None:
    from mlacheck.verdict import Verdict as RecordedVerdict

    v = RecordedVerdict(**{**passing(0).__dict__, "known_failure": "fixed upstream?"})
    s = summarise([v])
    assert s.by_status["XPASS"] == 1 and s.stale_known == [v]
    md = write_markdown([v], tmp_path / "r.md").read_text()
    assert "XPASS: known failure now PASSES" in md


# --------------------------------------------------------------------------- reports


def test_markdown_report(results: Path, tmp_path: Path) -> None:
    loaded = read_results(results)
    md = write_markdown(loaded.verdicts, tmp_path / "report.md", unparsable=loaded.skipped)
    text = md.read_text()
    assert "| aiter | mla_decode | 15 | 1 | 0 | 12 | 0 | 28 |" in text
    assert "| aiter | mla_prefill | 0 | 0 | 1 | 3 | 1 | 5 |" in text
    assert "| **all** | | 20 | 1 | 1 | 15 | 1 | 38 |" in text
    assert f"| aiter | mla_decode | {PAGE_REASON} | 12 |" in text
    assert "row_error: request 1 tokens 0-3 (rows 4-7), heads 2-3: worst 0.9 > bound 0.0625" in text
    assert KNOWN_REASON in text
    assert "1 unparsable line(s)" in text
    # failures come before the totals
    assert text.index("## Failures (2)") < text.index("## Totals")


def test_html_report_self_contained(results: Path, tmp_path: Path) -> None:
    loaded = read_results(results)
    html = write_html(loaded.verdicts, tmp_path / "report.html", unparsable=loaded.skipped)
    text = html.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text, re.I)
    assert "<link" not in text and "<script" not in text and "@import" not in text
    for needle in (
        FAIL_ID,
        CRASH_ID,
        KNOWN_REASON,
        PAGE_REASON,
        HEADS_REASON,
        "heads 2-3: worst 0.9 &gt; bound 0.0625",
        "pool bytes 0x80000000-0x80012000 (above 2^31)",
        "HIP error: invalid device function",
    ):
        assert needle in text, needle
    # failures are the first section; PASS rows are folded away
    assert text.index('id="failures"') < text.index('id="totals"') < text.index('id="cases"')
    assert "<details><summary>20 passing cases" in text
    badges = dict(re.findall(r'<span class="badge (\w+)(?: zero)?">(\d+) \1</span>', text))
    assert badges == {"PASS": "20", "FAIL": "1", "CRASH": "1", "SKIP": "15", "KNOWN": "1"}


def _svgs(text: str) -> dict[str, str]:
    """The report's inline SVG plots by their aria-label."""
    return dict((label, svg) for svg, label in re.findall(
        r'(<svg class="plot"[^>]*aria-label="([^"]*)".*?</svg>)', text, re.S))


def test_html_draws_every_plot_as_inline_svg_without_a_plotting_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33: the main job's install has no matplotlib, and its first report had no plots.
    The plots are SVG drawn with the standard library: status bars, error distributions and
    each failure's heat map, whose cells are one palette PNG inside. matplotlib is made
    unimportable here (another test in the same worker may have imported it: checking
    sys.modules afterwards failed by test order)."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    text = write_html(run_verdicts(), tmp_path / "report.html").read_text()
    assert "matplotlib" not in text
    svgs = _svgs(text)
    assert set(svgs) == {"status per backend and op", "error distributions",
                         f"error heat map of {FAIL_ID}"}
    heat = svgs[f"error heat map of {FAIL_ID}"]
    png = base64.b64decode(re.search(r'href="data:image/png;base64,([A-Za-z0-9+/=]+)"',
                                     heat).group(1))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    fx, fy = width // 16, height // 8  # 16 heads x 8 token rows, a block of pixels per cell
    assert (width, height) == (16 * fx, 8 * fy) and fx >= 1 and fy >= 1
    raw = zlib.decompress(png[png.index(b"IDAT") + 4 : png.index(b"IEND") - 8])

    def cell(t: int, h: int) -> int:  # its palette index
        return raw[t * fy * (1 + width) + 1 + h * fx]

    assert cell(7, 5) == plots_mod.NONFINITE_INDEX  # the non-finite row
    assert cell(7, 2) > cell(0, 0)  # 0.9 (beyond the bound: red) vs 0.01 (blue)
    assert "bound" in heat and "stroke-dasharray" in heat  # the bound's mark, the where boxes
    assert "0.9 vs bound 0.0625" in heat


def test_bad_heatmap_degrades_to_text(tmp_path: Path) -> None:
    v = failing()
    v.metrics["heatmap"] = [[1.0, 2.0], [3.0]]  # ragged: not a heat map
    text = write_html([v], tmp_path / "r.html").read_text()
    assert "error heat map" not in text and FAIL_ID in text


# --------------------------------------------------------------------------- cli


def test_main_writes_both_reports_next_to_results(results: Path, capsys) -> None:
    assert main([str(results)]) == 0
    out, err = capsys.readouterr()
    assert (results.parent / "report.md").is_file() and (results.parent / "report.html").is_file()
    assert str(results.parent / "report.html") in out
    assert out.strip().splitlines()[-1].startswith("38 cases: 20 PASS, 1 FAIL, 1 CRASH")
    assert "skipped 1 unparsable line" in err


def test_main_outdir(results: Path, tmp_path: Path) -> None:
    assert main([str(results), "-o", str(tmp_path / "out" / "deep")]) == 0
    assert (tmp_path / "out" / "deep" / "report.html").is_file()


@pytest.mark.parametrize("content", [None, b"", b"\n\n", b"{not json\n"])
def test_main_bad_input_exits_2(tmp_path: Path, capsys, content: bytes | None) -> None:
    p = tmp_path / "results.jsonl"
    if content is not None:
        p.write_bytes(content)
    assert main([str(p)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("mlacheck report: error:")
    assert not (tmp_path / "report.html").exists()


# --------------------------------------------------------------------------- real verdicts


class _OneHeadWrong:
    """The same-precision torch backend with head 3 of request 1 corrupted: a real FAIL."""

    name = "broken"

    def __init__(self) -> None:
        from mlacheck.backends.torch_ref import TorchBackend

        self._inner = TorchBackend()

    def unavailable(self) -> str | None:
        return None

    def capabilities(self) -> dict[str, Capability]:
        return self._inner.capabilities()

    def run(self, case: Case, inputs: DecodeInputs) -> Output:
        out = self._inner.run(case, inputs)
        lo, hi = inputs.qo_indptr.tolist()[1:3]
        out.out[lo:hi, 3] += 0.5
        return out


def test_report_of_real_judge_verdicts(tmp_path: Path) -> None:
    """Harness -> Verdict.to_json -> results file -> report: the judge's own where-messages."""
    from mlacheck.backends.torch_ref import TorchBackend
    from mlacheck.harness import run_case
    from mlacheck.spec import DecodeCase, Request

    case = DecodeCase(requests=(Request(1, 40), Request(2, 70)), num_heads=16)
    good, bad = run_case(case, TorchBackend()), run_case(case, _OneHeadWrong())
    assert (good.status, bad.status) == (PASS, FAIL)
    p = tmp_path / "results.jsonl"
    p.write_text(good.to_json() + "\n" + bad.to_json() + "\n")
    assert main([str(p)]) == 0
    md = (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    msg = bad.where[0].message("request")
    assert "request 1 (kv 70) tokens 0-1" in msg and "heads 3" in msg
    assert msg in md
    assert msg.replace(">", "&gt;") in html
    assert "| torch | mla_decode | 1 | 0 | 0 | 0 | 0 | 1 |" in md
    assert "| broken | mla_decode | 0 | 1 | 0 | 0 | 0 | 1 |" in md
    assert "heatmap" in bad.metrics and 'aria-label="error heat map of ' + case.id in html


def test_odd_verdicts_are_counted_not_fatal(tmp_path: Path) -> None:
    """Infinite worst row, exact zero, an all-zero heat map, an unknown status: all shown."""
    inf_fail = failing()
    inf_fail.metrics.update(worst_row=float("inf"), heatmap=[[0.0] * 4] * 3)
    zero = passing(99)
    zero.metrics["worst_row"] = 0.0
    odd = Verdict("odd-case", "aiter", "mla_decode", "XFAIL", reason="new status")
    vs = [inf_fail, zero, odd]
    s = summarise(vs)
    assert s.total_line() == "3 cases: 1 PASS, 1 FAIL, 0 CRASH, 0 SKIP, 0 KNOWN, 1 XFAIL"
    md = write_markdown(vs, tmp_path / "r.md").read_text()
    assert "| aiter | mla_decode | 1 | 1 | 0 | 0 | 0 | 1 | 3 |" in md
    html = write_html(vs, tmp_path / "r.html").read_text()
    assert "odd-case" in html and "new status" in html
    assert len(_svgs(html)) == 3  # status bars, distributions, the all-zero heat map


def test_heatmap_with_every_row_over_the_bound_keeps_its_layout() -> None:
    """Issue 16: when every row is far beyond the bound the bound's label was drawn off the
    colour bar and the figure grew a blank area. The bound sits on the colour scale and the
    plot keeps its size."""
    from mlacheck.harness import run_case
    from mlacheck.report.summary import Failure
    from mlacheck.spec import DecodeCase, Request

    class Wrong:
        name = "wrong"

        def __init__(self) -> None:
            from mlacheck.backends.torch_ref import TorchBackend

            self.inner = TorchBackend()

        def capabilities(self) -> dict[str, Capability]:
            return self.inner.capabilities()

        def unavailable(self) -> None:
            return None

        def run(self, case: Case, inputs: DecodeInputs) -> Output:
            res = self.inner.run(case, inputs)
            res.out.mul_(-3.0)  # every row far beyond the bound
            return res

    v = run_case(DecodeCase(requests=(Request(1, 37), Request(1, 300)), num_heads=16,
                            page_size=1024), Wrong())
    assert v.status == FAIL and v.metrics["worst_row"] > 100 * v.metrics["bound"]
    svg = plots_mod.error_heatmap(Failure(v, v.summary()))
    assert svg is not None
    width, height = (int(x) for x in re.search(r'width="(\d+)" height="(\d+)"', svg).groups())
    assert width <= 900 and height <= 600, (width, height)
    assert ">bound</text>" in svg
    # and the bound stays on the colour scale (drawn, not dropped) however far the rows are
    lo, hi = plots_mod._colour_range([float(v.metrics["worst_row"])], v.metrics["bound"])
    assert lo <= v.metrics["bound"] <= hi


# --------------------------------------------------------------------------- what ran (issue 33)


def _results_with_header(tmp_path: Path, verdicts: list[Verdict]) -> Path:
    """A results file as a run writes it: a run header (started 100 s before the first
    verdict), verdict lines stamped 100 s and 130 s after the start."""
    from mlacheck.results import new_header

    header = new_header([(v.backend, v.case_id) for v in verdicts], ["aiter", "torch"],
                        "smoke", "cpu", workers=2, started=1_700_000_000.0)
    lines = [header.to_line()]
    for i, v in enumerate(verdicts):
        d = json.loads(v.to_json())
        d["written"] = 1_700_000_000.0 + (130.0 if i == len(verdicts) - 1 else 100.0)
        lines.append(json.dumps(d) + "\n")
    p = tmp_path / "results.jsonl"
    p.write_text("".join(lines))
    return p


def test_report_header_says_what_ran_and_when(tmp_path: Path) -> None:
    """Issue 33: the title was always `mlacheck report: results.jsonl`. It names the matrix,
    the backends with their versions and the device; the header the machine, mlacheck's,
    torch's and Python's versions, the date, the wall time and the workers."""
    import mlacheck

    vs = run_verdicts()
    for v in vs:
        v.implementation = {"torch": "2.13.0", "version": f"lib-of-{v.backend} 1.2"}
    p = _results_with_header(tmp_path, vs)
    assert main([str(p)]) == 0
    md, html = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    title = "mlacheck report: matrix smoke x aiter, torch on cpu"
    assert md.startswith(f"# {title}\n") and f"<h1>{title}</h1>" in html
    for text in (md, html):
        assert "backends: aiter (lib-of-aiter 1.2); torch (lib-of-torch 1.2)" in text
        assert f"mlacheck {mlacheck.__version__}" in text and "torch " in text
        assert "python " in text and "machine: " in text
        assert re.search(r"started 2023-11-1[45] \d\d:\d\d:\d\d", text)
        assert "wall time 130.0 s, 2 workers" in text


def test_wall_time_beside_summed_time(tmp_path: Path) -> None:
    """Issue 33: `Time per phase: all 46.54 s` was the sum over workers' items; the report
    says so and puts the wall time (the run header's start to the last verdict) beside it."""
    p = _results_with_header(tmp_path, run_verdicts())
    loaded = read_results(p)
    assert loaded.wall_s == pytest.approx(130.0)
    md = write_markdown(loaded.verdicts, tmp_path / "r.md", headers=loaded.headers,
                        wall_s=loaded.wall_s).read_text()
    summed = sum(t.total for t in summarise(loaded.verdicts).timings)
    assert f"| **all phases, summed** | {summed:.2f} |" in md
    assert "| **wall time** | 130.00 |" in md
    assert "summed over every item; the run took 130.00 s of wall time on 2 workers" in md


def test_wall_time_of_a_resumed_file_adds_each_runs_span(tmp_path: Path) -> None:
    """Two runs over one file (--resume): each run's span counts, not the pause between."""
    from mlacheck.results import RunHeader, read_raw

    def header(t: float) -> str:
        return RunHeader((("b", "c"),), ("b",), "smoke", "cpu", t).to_line()

    def line(t: float) -> str:
        return json.dumps({"case_id": "c", "backend": "b", "written": t}) + "\n"

    p = tmp_path / "r.jsonl"
    p.write_text(header(1000.0) + line(1010.0) + line(1020.0) + header(5000.0) + line(5005.0))
    assert read_raw(p).wall_s == pytest.approx(25.0)
    p.write_text(header(1000.0) + json.dumps({"case_id": "c", "backend": "b"}) + "\n")
    assert read_raw(p).wall_s is None  # an old file: no stamps, no claim


def test_headline_is_not_green_over_thin_coverage() -> None:
    """Issue 33: `All 58 executed cases pass` headed a run where gfx942 executed 0 of 15
    mla_prefill items. A backend x op that executed under THIN_COVERAGE of its items turns
    the headline `partial` (amber, naming it); executed / skipped per backend x op is in the
    header."""
    from mlacheck.report.summary import THIN_COVERAGE

    def prefill(executed: int, total: int) -> list[Verdict]:
        ran = [passing(i, backend="gfx942", op="mla_prefill") for i in range(executed)]
        return ran + [Verdict(f"pf-skip{i}", "gfx942", "mla_prefill", SKIP, reason="gfx950 only")
                      for i in range(total - executed)]

    decode = [passing(i, backend="gfx942") for i in range(20, 30)]
    thin = summarise([*prefill(0, 15), *decode])
    text, tone = thin.headline()
    assert tone == "partial", text
    assert text == ("All 10 executed cases pass, but coverage is thin: 10 of 25 items "
                    f"executed (15 not); under {THIN_COVERAGE:.0%} executed: gfx942 "
                    "mla_prefill 0 of 15")
    html = render_html(thin, [])
    assert '<div class="headline partial">' in html
    assert "(thin)" in html and "<details open>" in html
    assert "**PARTIAL: All 10 executed cases pass, but" in render_markdown(thin)
    under = int(THIN_COVERAGE * 10) - 1
    assert summarise([*prefill(under, 10), *decode]).headline()[1] == "partial"
    assert summarise([*prefill(under + 1, 10), *decode]).headline()[1] == "good"
    full = summarise([*prefill(14, 15), *decode])
    assert full.headline() == ("All 24 executed cases pass (1 skipped)", "good")


def test_one_row_heat_map_gets_integer_ticks() -> None:
    """Issue 33: a one-row heat map had y ticks -0.5..0.5 in steps of 0.1. Ticks are whole
    token rows and heads at a 1-2-5 step, at most eight."""
    from mlacheck.report.summary import Failure

    assert plots_mod._int_ticks(1) == [0]
    assert plots_mod._int_ticks(16) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert plots_mod._int_ticks(128) == [0, 20, 40, 60, 80, 100, 120]
    assert plots_mod._int_ticks(256) == [0, 50, 100, 150, 200, 250]
    v = failing()
    v.metrics.update(heatmap=[[0.01] * 16], rows=16)
    v.where = v.where[:1]
    svg = plots_mod.error_heatmap(Failure(v, v.summary()))
    y_labels = re.findall(r'text-anchor="end"[^>]*>(-?[\d.]+)</text>', svg)
    assert y_labels == ["0"], y_labels
