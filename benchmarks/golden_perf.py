"""Performance of the suite itself on a GPU: golden throughput vs measured matmul throughput,
golden peak memory vs the case inputs, and the per-phase split of a results file.

    python benchmarks/golden_perf.py --device cuda [--results premerge.jsonl] [--json out.json]

Golden throughput counts the useful attention FLOPs (causal: only the visible half) divided
by the golden's wall time (median of REPEATS runs; the best is reported too), as a fraction of an fp32 (TF32 off) / fp64 8192^3 matmul measured
in the same run. Peak extra memory is the CUDA allocator's peak during the golden minus what
was allocated before it, divided by the bytes of the case inputs (q, k, v or the KV pool).
A third, untimed run counts the requests the golden had to redo in its careful pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from mlacheck import golden, inputs
from mlacheck.golden import core
from mlacheck.golden.core import exact_matmuls
from mlacheck.spec import DecodeCase, PrefillCase, Request, Segment

MATMUL_N = 8192  # square matmul used as the device's throughput yardstick
REPEATS = 5  # timed golden runs per case: the median is reported (and the best)


def matmul_tflops(dtype: torch.dtype, device: str, reps: int = 5) -> float:
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=dtype, device=device)
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=dtype, device=device)
    with exact_matmuls():
        torch.matmul(a, b)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / reps
    return 2 * MATMUL_N**3 / dt / 1e12


def attention_flops(case: PrefillCase | DecodeCase) -> float:
    d = case.dims
    if isinstance(case, PrefillCase):
        per_pair = 2 * (d.qk_head + d.v_head)
        pairs = sum(s.q_len * s.context_len + s.q_len * (s.q_len + 1) / 2 if case.causal
                    else s.q_len * s.kv_len for s in case.segments)
    else:
        per_pair = 2 * (d.latent + d.kv_lora_rank)
        pairs = sum(r.q_len * r.kv_len for r in case.requests)
    return pairs * case.num_heads * per_pair


def input_bytes(inp: inputs.Inputs) -> int:
    if isinstance(inp, inputs.PrefillInputs):
        ts = [inp.q.stored, inp.k.stored, inp.v.stored]
    else:
        ts = [inp.q.stored, inp.pool.data]
    return sum(t.numel() * t.element_size() for t in ts)


def count_redos() -> list[bool]:
    """Record each request the golden computes (False: fast pass, True: redone carefully)."""
    calls: list[bool] = []
    real = core._attend_one

    def spy(*a, careful: bool, **k):  # noqa: ANN002, ANN003
        calls.append(careful)
        return real(*a, careful=careful, **k)

    core._attend_one = spy
    return calls


def measure(case: PrefillCase | DecodeCase, inp: inputs.Inputs, precision: str) -> dict:
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    golden.reference(inp, "exact", precision)  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        golden.reference(inp, "exact", precision)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    dt, best = statistics.median(times), min(times)
    peak = torch.cuda.max_memory_allocated() - before
    flops = attention_flops(case)
    real = core._attend_one
    calls = count_redos()
    golden.reference(inp, "exact", precision)
    core._attend_one = real
    return {"case": case.slug, "precision": precision, "golden_s": round(dt, 4),
            "golden_best_s": round(best, 4), "tflops": round(flops / dt / 1e12, 2),
            "tflops_best": round(flops / best / 1e12, 2),
            "input_gib": round(input_bytes(inp) / 2**30, 3),
            "peak_extra_gib": round(peak / 2**30, 3),
            "peak_extra_over_inputs": round(peak / input_bytes(inp), 3),
            "requests": calls.count(False), "redone_carefully": calls.count(True)}


def phases(results: str) -> dict:
    tot: dict[str, float] = {}
    n = 0
    for line in Path(results).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        n += 1
        for k, v in (rec.get("timings") or {}).items():
            tot[k] = tot.get(k, 0.0) + float(v)
        tot["wall"] = tot.get("wall", 0.0) + float(rec.get("wall", 0.0))
    return {"cases": n, **{k: round(v, 1) for k, v in tot.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--device", default="cuda")
    p.add_argument("--results", action="append", default=[])
    p.add_argument("--json", default=None)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=128 * 1024)
    a = p.parse_args(argv)
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out["fp32_matmul_tflops"] = round(matmul_tflops(torch.float32, a.device), 1)
    out["fp64_matmul_tflops"] = round(matmul_tflops(torch.float64, a.device), 1)
    print(json.dumps(out), flush=True)
    cases = [
        PrefillCase(segments=(Segment(16384),), num_heads=128),
        DecodeCase(requests=tuple(Request(1, a.decode_context) for _ in range(a.decode_batch)),
                   num_heads=128, page_size=64),
    ]
    out["golden"] = []
    for c in cases:
        t = time.perf_counter()
        inp = inputs.build(c, a.device)
        torch.cuda.synchronize()
        build_s = round(time.perf_counter() - t, 2)
        for prec in ("fp32", "fp64"):
            r = {**measure(c, inp, prec), "inputs_build_s": build_s}
            ref = out[f"{prec}_matmul_tflops"]
            r["fraction_of_matmul"] = round(r["tflops"] / ref, 3)
            r["fraction_best"] = round(r["tflops_best"] / ref, 3)
            out["golden"].append(r)
            print(json.dumps(r), flush=True)
            torch.cuda.empty_cache()
        del inp
        torch.cuda.empty_cache()
    out["phases"] = {f: phases(f) for f in a.results}
    print(json.dumps(out["phases"]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
