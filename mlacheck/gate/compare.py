"""Compare a candidate run of a gate task with a baseline: verdict, markdown summary, plot.

The verdict is a non-inferiority test: PASS iff the one-sided ``1 - alpha`` lower confidence
bound of (candidate accuracy - baseline accuracy) lies above ``-margin``, the candidate run
completed with no failed request, its invalid-output rate is at most the ceiling, and (if
set) its accuracy reaches the floor. Paired statistics (Newcombe 1998b method 10 interval,
mid-p McNemar) are used on the documents both runs share; when the baseline has no
per-sample data the unpaired fallback (Wilson intervals, Newcombe 1998a hybrid score
interval) is used. See docs/gate.md for formulas and the meaning of the power statement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlacheck.gate import stats
from mlacheck.gate.errors import GateError
from mlacheck.gate.record import GateRecord
from mlacheck.gate.task import ROLES, STRICT
from mlacheck.gate.tasks import DEFAULT_TASK, get_task

# Non-inferiority margin in accuracy units (0.02 = 2 percentage points). A policy choice: the
# largest loss accepted without investigation. Bugs that matter (wrong pages, garbled heads,
# overflowing offsets) corrupt whole requests and cost more; a numerically correct change
# (FP8 KV cache, another reduction order) flips greedy answers in both directions with a net
# effect expected near zero. It is also about the finest margin GSM8K's full 1319-question
# test set resolves: the power statement's delta_min = 2.49 * sqrt(psi / 1319) is 1.5 points at
# psi = 5% discordant questions, 1.9 at 8%, 2.2 at 10% (docs/gate.md).
DEFAULT_MARGIN = 0.02
# One-sided significance level of the non-inferiority bound: the lower end of a two-sided
# 90% interval is a one-sided 95% bound. Every interval in the report is two-sided 90%.
DEFAULT_ALPHA = 0.05
# Power used in the power statement (the conventional 80%).
POWER = 0.80
# No absolute accuracy floor unless the user gives one: the right floor depends on the model.
DEFAULT_ACCURACY_FLOOR: float | None = None
# Highest tolerated fraction of candidate outputs without any answer or in a repetition loop.
# A healthy model answering 5-shot GSM8K almost always ends with a number; 5% leaves room for
# the odd truncated answer while catching a kernel that garbles one request in twenty.
DEFAULT_INVALID_RATE_CEILING = 0.05
# The gate decides on the strict-match role (for GSM8K the answer after "#### ", the format
# the few-shot examples teach); flexible-extract is reported alongside. A kernel that makes the
# model lose the answer format is caught by strict-match even if the last number is right.
DEFAULT_METRIC = STRICT

PAIRED = "paired"
UNPAIRED = "unpaired"


def report_names(task: str) -> tuple[str, str, str]:
    """File names of a task's compare report (markdown, plot, verdict JSON), e.g.
    gsm8k_gate.md: several tasks' reports can share one directory."""
    return f"{task}_gate.md", f"{task}_gate.png", f"{task}_gate.json"


# The default task's report files.
REPORT_MARKDOWN, REPORT_PLOT, REPORT_JSON = report_names(DEFAULT_TASK)


@dataclass(frozen=True)
class GatePolicy:
    margin: float = DEFAULT_MARGIN
    alpha: float = DEFAULT_ALPHA
    accuracy_floor: float | None = DEFAULT_ACCURACY_FLOOR
    invalid_rate_ceiling: float = DEFAULT_INVALID_RATE_CEILING
    metric: str = DEFAULT_METRIC

    def __post_init__(self) -> None:
        if not 0.0 < self.margin < 1.0:
            raise GateError(f"margin must lie in (0, 1) (accuracy units), got {self.margin}")
        if not 0.0 < self.alpha < 0.5:
            raise GateError(f"alpha must lie in (0, 0.5), got {self.alpha}")
        if self.accuracy_floor is not None and not 0.0 <= self.accuracy_floor <= 1.0:
            raise GateError(f"accuracy floor must lie in [0, 1], got {self.accuracy_floor}")
        if not 0.0 <= self.invalid_rate_ceiling <= 1.0:
            raise GateError(
                f"invalid-rate ceiling must lie in [0, 1], got {self.invalid_rate_ceiling}"
            )
        if self.metric not in ROLES:
            raise GateError(f"metric must be one of {', '.join(ROLES)}, got {self.metric!r}")

    @property
    def confidence(self) -> float:
        """Two-sided confidence of every reported interval."""
        return stats.two_sided_confidence(self.alpha)


@dataclass(frozen=True)
class Comparison:
    """Statistics of one metric."""

    metric: str
    mode: str  # PAIRED or UNPAIRED
    n_baseline: int
    n_candidate: int
    baseline_correct: int
    candidate_correct: int
    baseline: stats.Interval  # Wilson
    candidate: stats.Interval  # Wilson
    difference: stats.Interval  # candidate - baseline
    b: int | None  # paired: baseline right, candidate wrong
    c: int | None  # paired: baseline wrong, candidate right
    mcnemar_midp: float | None
    min_detectable_drop: float  # at one-sided alpha and POWER
    p_pass_if_equal: float  # probability an equally accurate candidate passes


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class GateVerdict:
    passed: bool
    policy: GatePolicy
    primary: Comparison | None  # None when the candidate has no scored sample
    secondary: tuple[Comparison, ...]
    checks: tuple[Check, ...]
    notes: tuple[str, ...]
    invalid_count: int
    invalid_rate: float
    baseline_meta: Mapping[str, Any]
    candidate_meta: Mapping[str, Any]
    task: str  # the gate task both runs ran

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- statistics --------------------------------------------------------------------------


def _paired(metric: str, pairs: list[tuple[bool, bool]], policy: GatePolicy) -> Comparison:
    n = len(pairs)
    a = sum(bb and cc for bb, cc in pairs)
    b = sum(bb and not cc for bb, cc in pairs)
    c = sum(cc and not bb for bb, cc in pairs)
    d = n - a - b - c
    conf = policy.confidence
    return Comparison(
        metric=metric,
        mode=PAIRED,
        n_baseline=n,
        n_candidate=n,
        baseline_correct=a + b,
        candidate_correct=a + c,
        baseline=stats.wilson_interval(a + b, n, conf),
        candidate=stats.wilson_interval(a + c, n, conf),
        # rows = candidate, columns = baseline: p1 - p2 = candidate - baseline
        difference=stats.newcombe_paired_interval(a, c, b, d, conf),
        b=b,
        c=c,
        mcnemar_midp=stats.mcnemar_midp(b, c),
        min_detectable_drop=stats.paired_min_detectable_difference(n, b + c, policy.alpha, POWER),
        p_pass_if_equal=stats.prob_pass_if_equal(
            policy.margin, stats.paired_standard_error(n, b + c), policy.alpha
        ),
    )


def _unpaired(metric: str, xb: int, nb: int, xc: int, nc: int, policy: GatePolicy) -> Comparison:
    conf = policy.confidence
    pb, pc = xb / nb, xc / nc
    return Comparison(
        metric=metric,
        mode=UNPAIRED,
        n_baseline=nb,
        n_candidate=nc,
        baseline_correct=xb,
        candidate_correct=xc,
        baseline=stats.wilson_interval(xb, nb, conf),
        candidate=stats.wilson_interval(xc, nc, conf),
        difference=stats.newcombe_unpaired_interval(xc, nc, xb, nb, conf),
        b=None,
        c=None,
        mcnemar_midp=None,
        min_detectable_drop=stats.unpaired_min_detectable_difference(
            pc, nc, pb, nb, policy.alpha, POWER
        ),
        p_pass_if_equal=stats.prob_pass_if_equal(
            policy.margin, stats.unpaired_standard_error(pc, nc, pb, nb), policy.alpha
        ),
    )


def _check_comparable(baseline: GateRecord, candidate: GateRecord) -> None:
    if baseline.task != candidate.task:
        raise GateError(
            f"runs are not comparable: {baseline.task} baseline vs {candidate.task} candidate"
        )
    bm, cm = baseline.metadata, candidate.metadata
    if bm.protocol_sha256 and cm.protocol_sha256 and bm.protocol_sha256 != cm.protocol_sha256:
        raise GateError(
            "runs are not comparable: different task protocol (prompt, filters, shots or "
            f"generation length; protocol {bm.protocol_sha256[:12]} vs {cm.protocol_sha256[:12]})"
        )
    if (
        bm.num_fewshot is not None
        and cm.num_fewshot is not None
        and bm.num_fewshot != cm.num_fewshot
    ):
        raise GateError(
            f"runs are not comparable: {bm.num_fewshot}-shot baseline vs {cm.num_fewshot}-shot candidate"
        )


def compare(baseline: GateRecord, candidate: GateRecord, policy: GatePolicy) -> GateVerdict:
    """The gate's verdict on ``candidate`` against ``baseline``.

    Raises GateError when the two cannot be compared (baseline incomplete, different
    protocols, same doc_id with different questions, nothing in common).
    """
    if not baseline.complete:
        raise GateError(
            f"baseline is not a complete run (status {baseline.status}, "
            f"{baseline.failed_requests} failed requests)"
        )
    if not baseline.has_samples and not baseline.metrics:
        raise GateError("baseline has neither per-sample data nor aggregate metrics")
    _check_comparable(baseline, candidate)
    notes: list[str] = []
    cand_samples = list(candidate.samples)

    if baseline.has_samples:
        base_by_id = {s.doc_id: s for s in baseline.samples}
        common = [s for s in cand_samples if s.doc_id in base_by_id]
        for s in common:
            if base_by_id[s.doc_id].doc_hash != s.doc_hash:
                raise GateError(
                    f"doc {s.doc_id} has a different question in baseline and candidate "
                    f"(hash {base_by_id[s.doc_id].doc_hash} vs {s.doc_hash}): different data sets"
                )
        if cand_samples and not common:
            raise GateError("baseline and candidate have no document in common")
        only_base = len(base_by_id) - len(common)
        only_cand = len(cand_samples) - len(common)
        if only_base or only_cand:
            notes.append(
                f"compared on the {len(common)} documents both runs scored "
                f"({only_base} only in baseline, {only_cand} only in candidate)"
            )
        compared = common
        comparisons = (
            {
                m: _paired(
                    m, [(base_by_id[s.doc_id].correct(m), s.correct(m)) for s in common], policy
                )
                for m in ROLES
            }
            if common
            else {}
        )
    else:
        notes.append(
            "baseline has no per-sample data: unpaired comparison (Wilson / Newcombe hybrid "
            "score), which needs a larger difference to decide than the paired one"
        )
        compared = cand_samples
        comparisons = {}
        if cand_samples:
            for m in ROLES:
                if m not in baseline.metrics:
                    continue
                summary = baseline.metrics[m]
                if summary.n < 1:
                    raise GateError(f"baseline {m} summary has n = 0")
                if abs(summary.accuracy * summary.n - summary.successes) > 0.01:
                    notes.append(
                        f"baseline {m} accuracy x n = {summary.accuracy * summary.n:.3f} is not a "
                        f"whole number; rounded to {summary.successes}"
                    )
                xc = sum(s.correct(m) for s in cand_samples)
                comparisons[m] = _unpaired(
                    m, summary.successes, summary.n, xc, len(cand_samples), policy
                )
        if cand_samples and policy.metric not in comparisons:
            raise GateError(f"baseline has no {policy.metric!r} accuracy")

    primary = comparisons.get(policy.metric)
    secondary = tuple(v for k, v in comparisons.items() if k != policy.metric)
    invalid = sum(s.invalid for s in compared)
    invalid_rate = invalid / len(compared) if compared else 0.0

    checks = [_completeness_check(candidate)]
    if primary is None:
        checks.append(Check("non-inferiority", False, "no scored candidate sample to compare"))
    else:
        lb = primary.difference.lower
        checks.append(
            Check(
                "non-inferiority",
                lb > -policy.margin,
                f"{_conf_one_sided(policy)} lower bound of candidate - baseline "
                f"{_pts(lb)} {'>' if lb > -policy.margin else '<='} -{_pts(policy.margin, sign=False)}",
            )
        )
        if policy.accuracy_floor is not None:
            acc = primary.candidate.estimate
            checks.append(
                Check(
                    "accuracy floor",
                    acc >= policy.accuracy_floor,
                    f"candidate {policy.metric} accuracy {acc:.2%} "
                    f"{'>=' if acc >= policy.accuracy_floor else '<'} floor {policy.accuracy_floor:.2%}",
                )
            )
        if primary.min_detectable_drop > policy.margin:
            notes.append(
                f"underpowered: the minimal detectable drop ({_pts(primary.min_detectable_drop, sign=False)}) "
                f"exceeds the margin ({_pts(policy.margin, sign=False)}); an equally accurate "
                f"candidate passes only with probability {primary.p_pass_if_equal:.0%}"
            )
    checks.append(
        Check(
            "invalid outputs",
            invalid_rate <= policy.invalid_rate_ceiling,
            f"{invalid}/{len(compared)} candidate outputs {get_task(candidate.task).no_answer} "
            "or looping "
            f"({invalid_rate:.2%} {'<=' if invalid_rate <= policy.invalid_rate_ceiling else '>'} "
            f"ceiling {policy.invalid_rate_ceiling:.2%})",
        )
    )
    if candidate.scored_by != baseline.scored_by and candidate.has_samples and baseline.has_samples:
        notes.append(f"candidate scored by {candidate.scored_by}, baseline by {baseline.scored_by}")
    return GateVerdict(
        passed=all(c.passed for c in checks),
        policy=policy,
        primary=primary,
        secondary=secondary,
        checks=tuple(checks),
        notes=tuple(notes),
        invalid_count=invalid,
        invalid_rate=invalid_rate,
        baseline_meta=_describe(baseline),
        candidate_meta=_describe(candidate),
        task=candidate.task,
    )


def _completeness_check(candidate: GateRecord) -> Check:
    if candidate.complete:
        return Check("run complete", True, f"all {candidate.n_planned} requests answered")
    detail = f"status {candidate.status}, {candidate.failed_requests} failed requests"
    if candidate.error:
        detail += f": {candidate.error}"
    return Check("run complete", False, detail)


def _describe(record: GateRecord) -> dict[str, Any]:
    meta = asdict(record.metadata)
    meta["status"] = record.status
    meta["n_samples"] = len(record.samples)
    if record.provenance is not None:
        meta["provenance"] = asdict(record.provenance)
    return meta


# --- text --------------------------------------------------------------------------------


def _pts(x: float, sign: bool = True) -> str:
    """Accuracy difference in percentage points."""
    return f"{100 * x:+.2f} pts" if sign else f"{100 * x:.2f} pts"


def _conf_one_sided(policy: GatePolicy) -> str:
    return f"{1 - policy.alpha:.0%} one-sided"


def summary_line(verdict: GateVerdict) -> str:
    word = "PASS" if verdict.passed else "FAIL"
    p = verdict.primary
    if p is None:
        details = "; ".join(c.detail for c in verdict.checks if not c.passed)
        return f"{word} {verdict.task}: {details}"
    extra = f", b={p.b}, c={p.c}" if p.mode == PAIRED else ""
    failed = [c.name for c in verdict.checks if not c.passed]
    tail = f" [failed: {', '.join(failed)}]" if failed else ""
    return (
        f"{word} {verdict.task} {p.metric}: candidate {p.candidate.estimate:.2%} vs baseline "
        f"{p.baseline.estimate:.2%}, difference {_pts(p.difference.estimate)}, "
        f"{_conf_one_sided(verdict.policy)} lower bound {_pts(p.difference.lower)} vs margin "
        f"-{_pts(verdict.policy.margin, sign=False)} ({p.mode}, n={p.n_candidate}{extra}){tail}"
    )


def power_statement(comp: Comparison, policy: GatePolicy) -> str:
    alpha, margin = policy.alpha, policy.margin
    if comp.mode == PAIRED:
        assert comp.b is not None and comp.c is not None
        disc = comp.b + comp.c
        design = (
            f"With n = {comp.n_candidate} paired questions and {disc} discordant "
            f"({disc / comp.n_candidate:.1%})"
        )
    else:
        design = (
            f"With {comp.n_candidate} candidate and {comp.n_baseline} baseline questions (unpaired)"
        )
    return (
        f"{design}, the gate resolves a true drop of {_pts(comp.min_detectable_drop, sign=False)} "
        f"(one-sided alpha = {alpha:g}, {POWER:.0%} power): a candidate truly as accurate as "
        f"the baseline passes the {_pts(margin, sign=False)} margin with probability "
        f"{comp.p_pass_if_equal:.0%}, and one truly {_pts(margin, sign=False)} worse fails with "
        f"probability about {1 - alpha:.0%}."
    )


def _ci(iv: stats.Interval, pct: bool = True) -> str:
    if pct:
        return f"{iv.estimate:.2%} [{iv.lower:.2%}, {iv.upper:.2%}]"
    return f"{_pts(iv.estimate)} [{_pts(iv.lower)}, {_pts(iv.upper)}]"


def render_markdown(verdict: GateVerdict, plot_name: str | None = None) -> str:
    pol = verdict.policy
    title = get_task(verdict.task).title
    word = "PASS" if verdict.passed else "FAIL"
    lines = [f"# {title} gate: {word}", "", summary_line(verdict), ""]
    lines += ["## Checks", "", "| check | result | detail |", "|---|---|---|"]
    for c in verdict.checks:
        lines.append(f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.detail} |")
    lines += [
        "",
        f"Policy: metric `{pol.metric}`, margin {_pts(pol.margin, sign=False)}, "
        f"one-sided alpha {pol.alpha:g} (intervals below are two-sided {pol.confidence:.0%}), "
        f"accuracy floor {'none' if pol.accuracy_floor is None else f'{pol.accuracy_floor:.2%}'}, "
        f"invalid-rate ceiling {pol.invalid_rate_ceiling:.2%}.",
        "",
    ]
    comps = ([verdict.primary] if verdict.primary else []) + list(verdict.secondary)
    if comps:
        lines += [
            "## Accuracy",
            "",
            "| metric | mode | n | baseline | candidate | candidate - baseline | b | c | mid-p McNemar |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for comp in comps:
            n = (
                str(comp.n_candidate)
                if comp.mode == PAIRED
                else f"{comp.n_baseline} / {comp.n_candidate}"
            )
            midp = "-" if comp.mcnemar_midp is None else f"{comp.mcnemar_midp:.4g}"
            lines.append(
                f"| {comp.metric}{' (gate)' if comp is verdict.primary else ''} | {comp.mode} | {n} | "
                f"{_ci(comp.baseline)} | {_ci(comp.candidate)} | {_ci(comp.difference, pct=False)} | "
                f"{'-' if comp.b is None else comp.b} | {'-' if comp.c is None else comp.c} | {midp} |"
            )
        lines += [
            "",
            "b: baseline right, candidate wrong; c: baseline wrong, candidate right. "
            "Paired difference interval: Newcombe (1998) method 10; unpaired: Newcombe hybrid "
            "score; accuracies: Wilson score.",
            "",
        ]
    if verdict.primary is not None:
        lines += ["## Power", "", power_statement(verdict.primary, pol), ""]
    if verdict.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in verdict.notes] + [""]
    lines += ["## Runs", "", "| | baseline | candidate |", "|---|---|---|"]
    keys = [
        "model",
        "backend",
        "base_url",
        "kv_dtype",
        "attention_backend",
        "server_args",
        "num_fewshot",
        "limit",
        "max_gen_toks",
        "data_source",
        "date",
        "status",
        "n_samples",
    ]
    bm, cm = verdict.baseline_meta, verdict.candidate_meta
    for k in keys:
        lines.append(f"| {k} | {_cell(bm.get(k))} | {_cell(cm.get(k))} |")
    for k in sorted(set(bm.get("versions", {})) | set(cm.get("versions", {}))):
        lines.append(
            f"| {k} version | {_cell(bm.get('versions', {}).get(k))} | "
            f"{_cell(cm.get('versions', {}).get(k))} |"
        )
    for k in sorted(set(bm.get("extra", {})) | set(cm.get("extra", {}))):
        lines.append(
            f"| {k} | {_cell(bm.get('extra', {}).get(k))} | {_cell(cm.get('extra', {}).get(k))} |"
        )
    prov = bm.get("provenance")
    if prov:
        lines += [
            "",
            f"Baseline `{prov['name']}` promoted by {prov['promoted_by']} on "
            f"{prov['promoted_at']}: {prov['reason']}",
        ]
    if plot_name:
        lines += ["", f"![{title} gate]({plot_name})"]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return str(value).replace("|", "\\|").replace("\n", " ")


# --- plot --------------------------------------------------------------------------------


def write_plot(verdict: GateVerdict, path: Path) -> None:
    """Accuracy of both runs with intervals, the difference interval against the margin,
    and the discordant counts b / c. Needs matplotlib (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comp = verdict.primary
    if comp is None:
        raise GateError("nothing to plot: the candidate has no scored sample")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    try:
        ax = axes[0]
        for x, (label, iv) in enumerate(
            (("baseline", comp.baseline), ("candidate", comp.candidate))
        ):
            ax.errorbar(
                x,
                100 * iv.estimate,
                yerr=[[100 * (iv.estimate - iv.lower)], [100 * (iv.upper - iv.estimate)]],
                fmt="o",
                capsize=6,
                color=("tab:blue", "tab:orange")[x],
                label=label,
            )
        ax.set_xticks([0, 1], ["baseline", "candidate"])
        ax.set_xlim(-0.6, 1.6)
        ax.set_ylabel(f"{comp.metric} accuracy (%)")
        ax.set_title(f"accuracy, {verdict.policy.confidence:.0%} Wilson")

        ax = axes[1]
        d = comp.difference
        color = "tab:green" if verdict.passed else "tab:red"
        ax.errorbar(
            0,
            100 * d.estimate,
            yerr=[[100 * (d.estimate - d.lower)], [100 * (d.upper - d.estimate)]],
            fmt="o",
            capsize=6,
            color=color,
        )
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.axhline(-100 * verdict.policy.margin, color="tab:red", ls="--", lw=1, label="-margin")
        ax.set_xticks([0], ["candidate - baseline"])
        ax.set_xlim(-1, 1)
        ax.set_ylabel("difference (points)")
        ax.set_title(f"{comp.mode} difference, {verdict.policy.confidence:.0%}")
        ax.legend(loc="best", fontsize=8)

        ax = axes[2]
        if comp.b is not None and comp.c is not None:
            bars = ax.bar(
                ["b: baseline only", "c: candidate only"],
                [comp.b, comp.c],
                color=["tab:blue", "tab:orange"],
            )
            ax.bar_label(bars)
            ax.margins(y=0.15)
            midp = comp.mcnemar_midp if comp.mcnemar_midp is not None else float("nan")
            ax.set_title(f"discordant questions (mid-p {midp:.3g})")
            ax.set_ylabel("questions")
        else:
            ax.text(0.5, 0.5, "unpaired baseline:\nno discordance", ha="center", va="center")
            ax.set_axis_off()
        fig.suptitle(
            f"{get_task(verdict.task).title} gate {'PASS' if verdict.passed else 'FAIL'}: "
            f"{comp.metric} difference {_pts(d.estimate)}, {_conf_one_sided(verdict.policy)} "
            f"lower bound {_pts(d.lower)} vs margin -{_pts(verdict.policy.margin, sign=False)}",
            fontsize=10,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
