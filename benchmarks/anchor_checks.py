"""The anchor projects' own test checks, applied to the same outputs as mlacheck's judge.

    # CPU: the fault catalogue and the correct torch backends over premerge (no large_kv)
    python benchmarks/anchor_checks.py --matrix premerge --seeds 1 --faults all \\
        -b torch -b torch-split -b torch-reverse -n 2 --out anchors.jsonl --table anchors.md
    # the H100: the real kernels (correct implementations: every anchor FAIL is a false alarm)
    python benchmarks/anchor_checks.py --device cuda --seeds 5 -b aiter-triton \\
        -b flashinfer -b flashinfer-fa3 -b flashmla -n 8 --budget 400 \\
        --out anchors-gpu.jsonl --table anchors-gpu.md
    # mlacheck's own checks on the same runs: per check, runs failed and closest approach
    python benchmarks/false_alarms.py --from anchors-gpu.jsonl

Each kernel projects whose tests are mlacheck's anchors judges its MLA kernels with one
comparison rule. Each is written below from its own source (file, commit, numbers), and
applied to exactly what mlacheck's judge sees: per (case, backend) the kernel runs once
(before the references, as mlacheck.harness runs it), then mlacheck's golden (fp32, on the
stored inputs), its same-precision baseline and `judge.verdict` (what run_case calls; the
probes after a FAIL only sharpen its diagnosis). Where an anchor's own reference is the fp32
result cast to the output dtype, the golden is cast so; where it compares LSEs, the LSE is
converted to its base. Rows where the golden is not finite (a query that sees no key) are
left out of every anchor rule (no anchor test has such rows); a kernel NaN elsewhere fails
them, as it would in their tests.

A correct backend's FAIL under a rule is a false alarm of that rule; a fault's FAIL a catch
where the rule passes every correct backend of the run on the same case. The table (--table) has,
per fault, the cases caught by mlacheck and by each rule, and the cases a low-false-alarm
rule catches that mlacheck passes; per correct backend, each rule's FAILs. `--from FILE`
tabulates an earlier run's JSON lines.

Work items are (seed, case): `-n` worker processes take them (a many-core machine runs the
full matrix x 20 seeds in minutes; each worker uses --threads torch threads).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlacheck import footprint, golden, judge
from mlacheck import inputs as inputs_mod
from mlacheck.backends.base import Backend, Output, skip_reason
from mlacheck.backends.faults import FAULTS, spec_of
from mlacheck.backends.registry import resolve
from mlacheck.harness import _baseline as baseline_family  # the product's own baselines
from mlacheck.matrices import load
from mlacheck.ops import Op
from mlacheck.spec import Case
from mlacheck.verdict import CRASH, FAIL, KNOWN, PASS, bucket

LOG2E = 1.0 / math.log(2.0)


# --------------------------------------------------------------------------- what a rule sees


@dataclass
class Seen:
    """One kernel output and its references, on the CPU, rows where the golden is finite."""

    case: Case
    out: torch.Tensor  # [N, Dv] kernel output, its own dtype
    gold: torch.Tensor  # [N, Dv] fp32 golden
    base: torch.Tensor  # [N, Dv] baseline output
    lse: torch.Tensor | None  # [N] natural log, or None (not returned / not asked)
    gold_lse: torch.Tensor  # [N]

    @property
    def fp8(self) -> bool:
        return self.case.quant.kv.startswith("fp8") or self.case.quant.q.startswith("fp8")

    @property
    def decode(self) -> bool:
        return Op(self.case.op).unit == "request"  # from a KV cache

    @property
    def sparse(self) -> bool:
        return self.case.op == Op.SPARSE_DECODE

    def ref(self) -> torch.Tensor:
        """The anchors' usual reference: computed in fp32, cast to the output dtype."""
        return self.gold.to(self.out.dtype)


Verdict = tuple[bool, str]  # (passed, the statistic that decided)


def isclose_fraction(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> float:
    """Fraction of elements not torch.isclose(a, b, rtol, atol): equal, or |a - b| <= atol +
    rtol |b| (NaN never close)."""
    a, b = a.double(), b.double()
    close = (a == b) | ((a - b).abs() <= atol + rtol * b.abs())
    return 1.0 - float(close.double().mean()) if close.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> Verdict:
    """torch.testing.assert_close: every element |actual - expected| <= atol + rtol |expected|,
    equal infinities match, NaN fails."""
    a, e = actual.double(), expected.double()
    ok = ((a - e).abs() <= atol + rtol * e.abs()) | ((a == e) & torch.isinf(e))
    bad = int((~ok).sum())
    return bad == 0, f"{bad} of {ok.numel()} elements beyond atol {atol:g} + rtol {rtol:g}"


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """cal_diff's / kernelkit's 1 - 2 <x, y> / (|x|^2 + |y|^2) (= |x - y|^2 / (|x|^2 + |y|^2))."""
    x, y = x.double(), y.double()
    return 1.0 - 2.0 * float((x * y).sum()) / max(float((x * x + y * y).sum()), 1e-12)


def _finite_lse(s: Seen) -> tuple[torch.Tensor, torch.Tensor] | None:
    if s.lse is None:
        return None
    keep = torch.isfinite(s.gold_lse)
    return s.lse[keep], s.gold_lse[keep]


# --------------------------------------------------------------------------- the rules


def aiter_logged(s: Seen) -> Verdict:
    """ROCm/aiter aiter/test_common.py (e4048607) checkAllclose(a, b, rtol=1e-2, atol=1e-2,
    tol_err_ratio=0.05): `isclose(a, b)` per element, logged "failed!" when more than 5% are
    not close; op_tests/test_mla.py calls it as checkAllclose(out_ref, out_asm) (out_ref
    computed in fp32, `.to(dtype)`) and checkAllclose(lse_ref, attn_lse) when the LSE is
    returned. Logged, not asserted: the return value is not checked."""
    frac = isclose_fraction(s.ref(), s.out, 1e-2, 1e-2)
    worst = frac
    pair = _finite_lse(s)
    if pair is not None:
        worst = max(worst, isclose_fraction(pair[1], pair[0], 1e-2, 1e-2))
    return worst <= 0.05, f"{worst:.2%} of elements not close at 1e-2 / 1e-2 (fails above 5%)"


def aiter_cal_diff(s: Seen) -> Verdict:
    """ROCm/aiter op_tests/test_mla.py (e4048607) cal_diff(out_ref, out_asm, "out", True):
    `assert cos_diff < 3e-2`, called on the FP8 decode paths only (the asserted AITER check;
    bf16 cases are only logged by checkAllclose)."""
    if not s.fp8:
        return True, "not asserted (bf16 / fp16: checkAllclose only logs)"
    c = cos_diff(s.out, s.ref())
    return c < 3e-2, f"cos_diff {c:.3g} (< 3e-2)"


def aiter_triton(s: Seen) -> Verdict:
    """ROCm/aiter op_tests/triton_tests/attention/test_mla.py (e4048607): atol, rtol =
    1.5e-2, 1e-2 (1.5e-1, 1.5e-1 when q or kv is FP8). Decode: `checkAllclose(output.bf16,
    ref.bf16, atol, rtol, tol_err_ratio=0.01) <= 0.01` (at most 1% of elements not close);
    prefill: torch.testing.assert_close(out, out_ref, atol, rtol)."""
    atol, rtol = (1.5e-1, 1.5e-1) if s.fp8 else (1.5e-2, 1e-2)
    ref = s.gold.to(torch.bfloat16)
    if s.decode:
        frac = isclose_fraction(s.out.to(torch.bfloat16), ref, atol, rtol)
        return frac <= 0.01, f"{frac:.2%} of elements not close at {atol:g} / {rtol:g} (<= 1%)"
    return assert_close(s.out, s.ref(), atol, rtol)


def flashinfer_deepseek(s: Seen) -> Verdict:
    """flashinfer-ai/flashinfer tests/attention/test_deepseek_mla.py (fb28d72):
    assert_close(o, o_ref, rtol=1e-3, atol=1e-3) (o_ref fp32 `.to(q)`) and assert_close(lse,
    lse_ref, rtol=1e-3, atol=1e-3) on the base-2 LSE (`lse_ref * math.log2(math.e)`)."""
    ok, detail = assert_close(s.out, s.ref(), 1e-3, 1e-3)
    pair = _finite_lse(s)
    if ok and pair is not None:
        ok, lse_detail = assert_close(pair[0] * LOG2E, pair[1] * LOG2E, 1e-3, 1e-3)
        detail = f"{detail}; LSE: {lse_detail}"
    return ok, detail


def flashinfer_trtllm(s: Seen) -> Verdict:
    """flashinfer-ai/flashinfer tests/attention/test_trtllm_gen_mla.py (fb28d72): `assert not
    torch.isnan(output).any()`, then assert_close(output, o_ref, rtol=atol=1e-2; 1e-1 for FP8);
    sparse MLA: rtol 2e-2, atol 8e-4 (FP8: 1e-1); the LSE is only checked finite."""
    if bool(torch.isnan(s.out).any()):
        return False, "output is nan"
    if s.sparse:
        atol, rtol = (1e-1, 1e-1) if s.fp8 else (8e-4, 2e-2)
    else:
        atol, rtol = (1e-1, 1e-1) if s.fp8 else (1e-2, 1e-2)
    ok, detail = assert_close(s.out.float(), s.ref().float(), atol, rtol)
    pair = _finite_lse(s)
    if ok and pair is not None and not bool(torch.isfinite(pair[0]).all()):
        return False, "LSE not finite"
    return ok, detail


# deepseek-ai/FlashMLA tests (9241ae3): (out abs_tol, rel_tol, cos_diff_tol), (LSE abs, rel)
KERNELKIT = {
    "decode": ((8e-4, 2.01 / 128, 5e-6), (1e-6, 8.01 / 65536)),  # test_flash_mla_dense_decoding.py
    "sparse": ((1e-3, 2.01 / 128, 5e-6), (1e-6, 8.01 / 65536)),  # test_flash_mla_sparse_decoding.py
    "prefill": ((8e-4, 3.01 / 128, 7e-6), (1e-6, 2.01 / 65536)),  # test_flash_mla_sparse_prefill.py
}


def check_is_allclose(ans: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float,
                      cos_diff_tol: float) -> Verdict:
    """deepseek-ai/FlashMLA tests/kernelkit/compare.py check_is_allclose: inf / -inf / NaN at
    the same positions; every element abs_err < abs_tol or rel_err < rel_tol (rel = abs /
    (|ref| + 1e-6)); then cos_diff <= cos_diff_tol."""
    ans, ref = ans.double().clone(), ref.double().clone()
    for is_val in (lambda t: t == math.inf, lambda t: t == -math.inf, torch.isnan):
        ma, mr = is_val(ans), is_val(ref)
        if not torch.equal(ma, mr):
            return False, "inf / NaN positions differ"
        ans[ma], ref[mr] = 0.0, 0.0
    c = cos_diff(ans, ref) if float((ref * ref).sum()) >= 1e-12 else 0.0
    raw_abs = (ans - ref).abs()
    raw_rel = raw_abs / (ref.abs() + 1e-6)
    rel = raw_rel.masked_fill(raw_abs < abs_tol, 0)
    abs_ = raw_abs.masked_fill(raw_rel < rel_tol, 0)
    bad = int((~((abs_ < abs_tol) | (rel < rel_tol))).sum())
    if bad:
        return False, f"{bad} of {ans.numel()} elements beyond abs {abs_tol:g} and rel {rel_tol:.3g}"
    return abs(c) <= cos_diff_tol, f"cos_diff {c:.3g} (<= {cos_diff_tol:g})"


def flashmla_kernelkit(s: Seen) -> Verdict:
    """deepseek-ai/FlashMLA (9241ae3) tests/kernelkit check_is_allclose with each test's own
    numbers (KERNELKIT): decode against out_ref `.to(q.dtype)`, sparse prefill against the fp32
    reference; the LSE (natural log) with its own tolerances and check_is_allclose's default
    cos_diff_tol 1e-7."""
    kind = "sparse" if s.sparse else "decode" if s.decode else "prefill"
    (a, r, c), (la, lr) = KERNELKIT[kind]
    ref = s.gold if kind == "prefill" else s.ref()
    ok, detail = check_is_allclose(s.out, ref.to(s.out.dtype) if kind != "prefill" else ref, a, r, c)
    pair = _finite_lse(s)
    if ok and pair is not None:
        ok, lse_detail = check_is_allclose(pair[0].float(), pair[1].float(), la, lr, 1e-7)
        detail = f"{detail}; LSE: {lse_detail}"
    return ok, detail


def cal_diff_old(s: Seen) -> Verdict:
    """The older FlashMLA tests/test_flash_mla.py (c2067be) cal_diff, kept by vLLM's
    tests/kernels/attention/test_flashmla.py: `assert cos_diff < 1e-5` (FP8: 1e-4, vLLM) on
    the output against the fp32 reference, and `< 1e-5` on the LSE."""
    tol = 1e-4 if s.fp8 else 1e-5
    c = cos_diff(s.out, s.gold)
    worst = f"out cos_diff {c:.3g} (< {tol:g})"
    ok = c < tol
    pair = _finite_lse(s)
    if pair is not None:
        cl = cos_diff(pair[0], pair[1])
        ok &= cl < 1e-5
        worst += f", LSE {cl:.3g} (< 1e-5)"
    return ok, worst


def vllm_rocm(s: Seen) -> Verdict:
    """vllm-project/vllm tests/kernels/attention/test_rocm_aiter_mla_decode.py (4e4c000):
    `ATOL, RTOL = 1.5e-2, 1e-2`, assert_close(output, output_ref) (fp32 reference `.to(q.dtype)`);
    FP8: tests/kernels/attention/rocm_aiter_tolerances.py (f89fedd) MLA_FP8_PREFILL (atol
    2.6e-1, rtol 5e-2), its only FP8 MLA tolerance."""
    atol, rtol = (2.6e-1, 5e-2) if s.fp8 else (1.5e-2, 1e-2)
    return assert_close(s.out, s.ref(), atol, rtol)


def flashattention(s: Seen) -> Verdict:
    """Dao-AILab/flash-attention tests/test_flash_attn.py (0251105): `(out - out_ref).abs().max()
    <= 2 * (out_pt - out_ref).abs().max()` (forward, varlen), decode against a KV cache
    (test_flash_attn_kvcache) `<= 3 * ... + 1e-5`; out_ref the fp32 reference, out_pt the
    same-precision PyTorch one (here the golden and mlacheck's baseline)."""
    err = float((s.out.double() - s.gold.double()).abs().max()) if s.out.numel() else 0.0
    base = float((s.base.double() - s.gold.double()).abs().max()) if s.out.numel() else 0.0
    mult, add = (3.0, 1e-5) if s.decode else (2.0, 0.0)
    bound = mult * base + add
    return err <= bound, f"max abs {err:.3g} vs {mult:g} x baseline {base:.3g}" + (
        f" + {add:g}" if add else "")


RULES: dict[str, Callable[[Seen], Verdict]] = {
    "flashattention": flashattention,
    "aiter-triton": aiter_triton,
    "flashinfer-trtllm": flashinfer_trtllm,
    "aiter-logged": aiter_logged,
    "aiter-cal-diff": aiter_cal_diff,
    "vllm-rocm": vllm_rocm,
    "cal-diff-old": cal_diff_old,
    "flashmla-kernelkit": flashmla_kernelkit,
    "flashinfer-deepseek": flashinfer_deepseek,
}
# The rules an independent audit measured with few or no false alarms on mlacheck's inputs:
# mlacheck must catch at least what they catch (docs/detection.md "Anchor rules").
LOW_FALSE_ALARM = ("flashattention", "aiter-triton", "flashinfer-trtllm", "aiter-logged")


def seen(case: Case, output: Output, gold: torch.Tensor, gold_lse: torch.Tensor,
         base: torch.Tensor) -> Seen:
    out = output.out.detach().cpu()
    g, b = gold.detach().cpu(), base.detach().cpu()
    keep = torch.isfinite(g).all(-1)
    wants_lse = case.return_lse
    lse = output.lse.detach().cpu().float()[keep] if output.lse is not None and wants_lse else None
    return Seen(case, out[keep], g[keep], b[keep], lse, gold_lse.detach().cpu().float()[keep])


def judge_rules(s: Seen) -> dict[str, list[Any]]:
    return {name: list(rule(s)) for name, rule in RULES.items()}


# --------------------------------------------------------------------------- the pipeline


def _judged(case: Case, backend: Backend, device: str, data: dict[str, Any],
            repeat: bool) -> dict[str, Any]:
    """One backend on one case: mlacheck's verdict and every anchor rule's."""
    inp = data["inputs"]
    inp.out.full.copy_(data["pristine"])
    try:
        output = backend.run(case, inp)
        if device != "cpu":
            torch.cuda.synchronize()
    except Exception as e:  # the kernel under test failed: CRASH for every rule alike
        return {"status": CRASH, "reason": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    if data.get("refs") is None:
        saved = inp.out.full.clone()
        gold = golden.reference(inp, "exact")
        ideal = golden.reference(inp, "ideal")
        family = baseline_family(case, inp)  # BASELINE first (+ the P-normalised one, FP8 P)
        inp.out.full.copy_(saved)
        data["refs"] = (gold, ideal, family)
    gold, ideal, family = data["refs"]
    repeats = None
    if repeat:  # a fault that only a repeated run shows: the determinism check needs it
        repeats = judge.Repeats([backend.run(case, inputs_mod.build(case, device))])
    clock = time.perf_counter()
    v = judge.verdict(case, inp, output, gold, family, ideal, backend.name, repeats)
    judged_s = time.perf_counter() - clock
    # the anchor rules compare attention outputs and their LSE; the indexer's logits and
    # top-k (golden.pipeline_ops.LogitsResult, no LSE) have none: mlacheck's verdict alone
    rules = (judge_rules(seen(case, output, gold.out, gold.lse, family[0].out))
             if hasattr(gold, "lse") else None)
    return {"status": v.status, "judge_s": round(judged_s, 3),
            "checks": {c.name: [c.passed, c.value, c.bound] for c in v.checks},
            "known": v.known_rule, "failed": [c.name for c in v.failed_checks],
            **({"rules": rules} if rules is not None else {}),
            "metrics": {k: v.metrics.get(k) for k in (
                "worst_row", "bound", "rms_error", "baseline_rms_error", "max_abs_error",
                "baseline_max_abs_error")}}


_BACKENDS: dict[str, Backend] = {}  # one instance per process: a stateful fault keeps its state


def _backend(name: str) -> Backend:
    if name not in _BACKENDS:
        _BACKENDS[name] = resolve(name)
    return _BACKENDS[name]


def _work(item: tuple[str, int, int, list[str], str]) -> list[dict[str, Any]]:
    matrix, seed, index, names, device = item
    case = load(matrix, seed).cases[index].case
    rows = []
    data: dict[str, Any] | None = None
    for name in names:
        backend = _backend(name)
        why = skip_reason(backend, case, device) or footprint.does_not_fit(case, device)
        if why:
            continue
        if data is None:
            inp = inputs_mod.build(case, device)
            data = {"inputs": inp, "pristine": inp.out.full.clone()}
        fault = name.startswith("fault:")
        try:
            rec = _judged(case, backend, device, data,
                          repeat=fault and spec_of(name).determinism)
        except Exception as e:  # noqa: BLE001 - the suite's own error, never the kernel's
            rec = {"status": "ERROR", "reason": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        rows.append({"seed": seed, "case": case.id, "op": case.op, "kv": case.quant.kv,
                     "backend": name, "fault": fault, **rec})
    return rows


def _init(threads: int) -> None:
    torch.set_num_threads(threads)


def items(matrix: str, seeds: int, names: list[str], device: str, exclude: list[str],
          pattern: str = "") -> Iterator[tuple[str, int, int, list[str], str]]:
    for seed in range(seeds):
        for i, mc in enumerate(load(matrix, seed).cases):
            if not set(mc.markers) & set(exclude) and pattern in mc.case.id:
                yield matrix, seed, i, names, device


# --------------------------------------------------------------------------- the table


def table(rows: list[dict[str, Any]]) -> str:
    """Per correct backend: each rule's FAILs (its false alarms). Per fault: the cases caught
    by mlacheck and by each rule, a rule's catch counted only where every correct backend of
    the run passes that rule on the same seed and case (elsewhere its FAIL does not tell the
    fault from a correct implementation), and the cases a low-false-alarm rule catches so
    that mlacheck passes."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    correct_fail: dict[tuple[int, str], set[str]] = defaultdict(set)  # rules a correct one fails
    for r in rows:
        if "rules" in r:  # the kernel returned an output every rule judged
            by[r["backend"]].append(r)
            if not r["fault"]:
                correct_fail[(r["seed"], r["case"])] |= {n for n, v in r["rules"].items()
                                                         if not v[0]}
    names = list(RULES)

    def caught(r: dict[str, Any], n: str) -> bool:
        return not r["rules"][n][0] and (
            not r["fault"] or n not in correct_fail[(r["seed"], r["case"])])

    head = ("| backend | runs | mlacheck | " + " | ".join(names)
            + " | low-FA rules catch, mlacheck passes |\n|" + "---|" * (len(names) + 4) + "\n")
    lines = []
    for name in sorted(by, key=lambda n: (n.startswith("fault:"), n)):
        rs = by[name]
        ml = sum(r["status"] == FAIL for r in rs)
        known = sum(bucket(r["status"], bool(r.get("known"))) == KNOWN for r in rs)
        cells = [str(sum(caught(r, n) for r in rs)) for n in names]
        missed = sorted({r["case"] for r in rs if r["fault"] and r["status"] == PASS
                         and any(caught(r, n) for n in LOW_FALSE_ALARM)})
        lines.append(f"| {name} | {len(rs)} | {ml}{f' ({known} KNOWN)' if known else ''} | "
                     + " | ".join(cells)
                     + f" | {len(missed)}{': ' + ', '.join(missed[:3]) if missed else ''} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--matrix", default="premerge")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("-b", "--backend", action="append", default=None,
                   help="correct backends (default: torch, torch-split, torch-reverse)")
    p.add_argument("--faults", default="", help="'all' or a comma-separated list of faults")
    p.add_argument("--device", default="cpu")
    p.add_argument("-n", "--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("-m", dest="exclude_markers", action="append", default=None,
                   help="skip cases with these markers (default: gpu on a CPU, large_kv)")
    p.add_argument("-k", dest="pattern", default="", help="only cases whose id contains this")
    p.add_argument("--out", default="anchors.jsonl")
    p.add_argument("--table", default=None)
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds: take no new item after this, tabulate what finished (items "
                        "go seed by seed, so the first seeds finish whole)")
    p.add_argument("--from", dest="source", nargs="+", default=None,
                   help="tabulate these JSON-lines files (no run)")
    a = p.parse_args(argv)
    if a.source:
        rows = [json.loads(line) for f in a.source
                for line in Path(f).read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0
    names = list(a.backend or ["torch", "torch-split", "torch-reverse"])
    if a.faults:
        wanted = list(FAULTS) if a.faults == "all" else a.faults.split(",")
        names += [spec_of(f).backend_name for f in wanted]
    exclude = a.exclude_markers or (["gpu", "large_kv"] if a.device == "cpu" else ["large_kv"])
    work = list(items(a.matrix, a.seeds, names, a.device, exclude, a.pattern))
    start, rows = time.time(), []
    deadline = start + a.budget if a.budget > 0 else math.inf
    with open(a.out, "w") as out:
        if a.workers > 1:
            ctx = mp.get_context("spawn")
            with ctx.Pool(a.workers, initializer=_init, initargs=(a.threads,)) as pool:
                results: Iterator[list[dict[str, Any]]] = pool.imap_unordered(_work, work)
                rows = _collect(results, out, len(work), start, deadline)
            # leaving the pool terminates the workers still running past the budget
        else:
            _init(a.threads)
            rows = _collect(map(_work, work), out, len(work), start, deadline)
    text = table(rows)
    print(text)
    if a.table:
        with open(a.table, "w") as f:
            f.write(text)
    correct_alarms = sum(bucket(r["status"], bool(r.get("known"))) == FAIL for r in rows
                         if not r["fault"])
    done = {(r["seed"], r["case"]) for r in rows}
    per_seed = ", ".join(f"seed {s}: {sum(1 for d in done if d[0] == s)}/"
                         f"{sum(1 for w in work if w[1] == s)}"
                         for s in sorted({w[1] for w in work}))
    print(f"{len(work)} (seed, case) items ({per_seed} with a judged run), {len(rows)} judged "
          f"runs, {time.time() - start:.0f}s; mlacheck FAILs on correct backends (not KNOWN "
          f"findings): {correct_alarms}")
    return 1 if correct_alarms else 0


def _collect(results: Iterator[list[dict[str, Any]]], out: Any, total: int,
             start: float, deadline: float = math.inf) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for done, batch in enumerate(results, 1):
        for r in batch:
            out.write(json.dumps(r, default=str) + "\n")
        out.flush()
        rows += batch
        if done % 20 == 0 or done == total:
            print(f"{done}/{total} items ({time.time() - start:.0f}s)", file=sys.stderr, flush=True)
        if time.time() > deadline:
            print(f"budget spent: {done}/{total} items ({time.time() - start:.0f}s)",
                  file=sys.stderr, flush=True)
            break
    return rows


if __name__ == "__main__":
    sys.exit(main())
