"""The dose-response doses (mlacheck.e2e.faults) planted in the model's attention, and the
kernel-level judge on the model's own calls (mlacheck.e2e.kernel_verdicts): every planted
fault the loop reaches is caught on the calls it corrupts, the correct controls and the
faults the loop never reaches are not."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from _e2e_helpers import REPO, tiny_model

from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.e2e.faults import DOSES, dose, planted, stale_table
from mlacheck.e2e.kernel_verdicts import KernelVerdicts
from mlacheck.e2e.runner import DEFAULT_PLACEMENT, AttentionConfig, MLARunner
from mlacheck.kvcache import PageTable
from mlacheck.spec import Quant
from mlacheck.verdict import FAIL, PASS

# Prompts of different tokens, long enough for two pages of 16 (the stale page is the
# second) and of mixed lengths, so that some decode step has a kv length that is a multiple
# of the page size.
PROMPTS = [[1, *range(3 + 7 * i, 3 + 7 * i + n)] for i, n in enumerate((40, 33, 57, 46))]
NEW = 8
# Doses the judge must not fail on these calls: the correct controls, the bug whose
# tail reads are harmless when free memory is finite, and the tile bound at kv 256 (the
# model's sequences stay far shorter).
CLEAN = {"control-split-kv", "control-fp8", "tail-times-zero-finite", "tile-256-drops-last"}


def _run(name: str, steps: frozenset[int] = frozenset(range(NEW)),
         layers: frozenset[int] = frozenset(range(8))) -> tuple[list, KernelVerdicts]:
    d = dose(name)
    att = AttentionConfig(quant=d.quant or Quant(), page_size=16,
                          placement=dataclasses.replace(DEFAULT_PLACEMENT,
                                                        tail_poison=d.tail_poison))
    decode, prefill = planted(d, TorchBackend(), att.page_size)
    model = tiny_model()
    judged = KernelVerdicts(decode, prefill, model.config.num_hidden_layers, decode_steps=steps,
                            prefill_layers=layers)
    runner = MLARunner(model, decode, att, observer=judged, prefill_backend=prefill)
    out = runner.generate(PROMPTS, NEW)
    runner.generate(PROMPTS[:2], 1)  # a second batch that stops after its prefill
    runner.generate(PROMPTS[2:], 2)
    return out, judged


@pytest.mark.parametrize("name", [d.name for d in DOSES])
def test_each_dose_is_caught_on_the_calls_it_corrupts(name: str) -> None:
    _, judged = _run(name)
    layers = tiny_model().config.num_hidden_layers
    # every call judged: three batches' prefills, decode steps of the first and the last
    assert len(judged.records) == 3 * layers + layers * (NEW - 1) + layers
    assert judged.errors == 0, judged.records
    statuses = {r["status"] for r in judged.records}
    if name in CLEAN:
        assert statuses == {PASS}, judged.summary()
    else:
        assert judged.failed > 0, judged.summary()
        assert statuses <= {PASS, FAIL}


def test_the_faults_act_where_they_say() -> None:
    _, lse = _run("lse-base2")
    assert {c for r in lse.records for c in r.get("checks", ())} == {"lse"}  # output right
    _, drop = _run("drop-full-last-page")
    # only decode calls in which some request's kv length is a multiple of 16 fail
    assert all(r["op"] == "mla_decode" for r in drop.records if r["status"] == FAIL)
    assert any(r["status"] == PASS for r in drop.records if r["op"] == "mla_decode")
    _, nan = _run("tail-times-zero-nan")
    assert any("nonfinite" in r.get("checks", ()) for r in nan.records)


def test_planted_keeps_the_ops_a_fault_does_not_act_on_on_the_inner_backend() -> None:
    inner = TorchBackend()
    decode, prefill = planted(dose("stale-page"), inner, 16)
    assert prefill is inner and decode is not inner
    decode, prefill = planted(dose("perturb-row-5%"), inner, 16)
    assert decode is prefill is not inner
    with pytest.raises(KeyError, match="unknown dose 'nope'; known: control-split-kv"):
        dose("nope")


def test_stale_table_swaps_one_page_per_request_with_the_next() -> None:
    # three requests of 3, 1 and 2 pages (page size 4)
    table = PageTable(4, torch.tensor([0, 3, 4, 6]), torch.tensor([10, 11, 12, 20, 30, 31]),
                      torch.tensor([12, 3, 7]))
    got = stale_table(table, 1)
    # request 0's second page comes from request 1 (which has none: kept), request 2's from
    # request 0 (cyclic)
    assert got.indices.tolist() == [10, 11, 12, 20, 30, 11]
    assert stale_table(table, 0).indices.tolist() == [20, 11, 12, 30, 10, 31]
    assert torch.equal(got.kv_lens, table.kv_lens) and torch.equal(got.indptr, table.indptr)


def test_kernel_verdicts_sample_decode_steps_per_batch() -> None:
    _, judged = _run("control-split-kv", steps=frozenset({0, 3}), layers=frozenset({0}))
    layers = tiny_model().config.num_hidden_layers
    steps = [(r["batch"], r["step"]) for r in judged.records]
    assert steps == [(0, None), *[(0, 0)] * layers, *[(0, 3)] * layers, (1, None), (2, None),
                     *[(2, 0)] * layers]
    assert judged.summary()["mla_decode"] == {"judged": 3 * layers, "status": {PASS: 3 * layers},
                                              "checks": {}}


def _benchmark(name: str):  # noqa: ANN202
    """A benchmarks/ script as a module (registered: its dataclasses need their module)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_dose_response_benchmark_end_to_end(tmp_path: Path) -> None:
    """benchmarks/e2e_dose_response.py: run and table on a tiny model: the table says
    which layer saw each fault."""
    pytest.importorskip("lm_eval", reason="needs lm-eval")
    from mlacheck.e2e.checkpoint import save_model
    from mlacheck.e2e.tokenizer import CharTokenizer

    bench = _benchmark("e2e_dose_response")
    model = tmp_path / "model"
    save_model(tiny_model(), model, dtype=torch.float32)
    CharTokenizer().save(model)
    out = tmp_path / "out"
    argv = ["run", "--model", str(model), "--out-dir", str(out), "--n", "2", "--max-gen-toks",
            "6", "--no-baseline", "--doses", "lse-base2"]
    assert bench.main(argv) == 0
    assert bench.main([*argv[:-1], "decode-scale-1/sqrt(576)", "--inner", "torch-split"]) == 0
    # the run itself as the baseline (one gate run less): no answer differs (the random
    # model's answers hold no number, so the gate still FAILs on invalid outputs)
    assert bench.main(["table", str(out), "--baseline", str(out / "lse-base2.json")]) == 0
    rows = {r["dose"]: r for r in json.loads((out / "dose_response.json").read_text())}
    lse = rows["lse-base2"]
    assert (lse["b"], lse["c"], lse["kernel_level"], lse["checks"]) == (0, 0, "FAIL", ["lse"])
    assert lse["seen_by"] == ("both" if lse["gate"] == "FAIL" else "kernel checks only")
    # a dose planted in the torch backend's arithmetic is not run over another backend
    assert rows["decode-scale-1/sqrt(576)"]["note"].startswith("planted in the torch backend")
    assert "| lse-base2 |" in (out / "dose_response.md").read_text()


def test_kernel_gate_driver_runs_compares_and_keeps_every_exit_code(tmp_path: Path) -> None:
    """benchmarks/e2e_kernel_gate.py on CPU with the reference configuration: the run's exit
    code and record, the compare's exit code and verdict; runs past the budget are recorded
    as not started, never dropped."""
    pytest.importorskip("lm_eval", reason="needs lm-eval")
    from mlacheck.e2e.checkpoint import save_model
    from mlacheck.e2e.problems import write_gsm8k_dir
    from mlacheck.e2e.tokenizer import CharTokenizer

    gate = _benchmark("e2e_kernel_gate")
    assert [r.name for r in gate.RUNS][0] == "torch-bf16-p16"
    model = tmp_path / "model"
    save_model(tiny_model(), model, dtype=torch.float32)
    CharTokenizer().save(model)
    data = write_gsm8k_dir(tmp_path / "data", n_train=2, n_test=2)
    out = tmp_path / "out"
    common = ["run", "--model", str(model), "--out-dir", str(out), "--data-dir", str(data),
              "--device", "cpu", "--n", "2", "--jobs", "1"]
    assert gate.main([*common, "--runs", "torch-bf16-p16"]) == 0
    # no budget left: recorded as not started (and the exit status says not everything ran)
    assert gate.main([*common, "--runs", "flashinfer-bf16-p16", "--budget-s", "0"]) == 2
    assert gate.main(["table", str(out), "--baseline", str(out / "torch-bf16-p16.json")]) == 0
    rows = {r["name"]: r for r in json.loads((out / "kernel_gate.json").read_text())}
    ref = rows["torch-bf16-p16"]
    assert ref["rc"] == 0 and ref["compare_rc"] in (0, 1) and ref["compare"]["primary"]["b"] == 0
    assert rows["flashinfer-bf16-p16"]["status"] == "not started: budget spent"
    md = (out / "kernel_gate.md").read_text()
    assert "| flashinfer-bf16-p16 | flashinfer / torch |" in md
    # the verdict column says the verdict (PASS, or FAIL and the failed checks), not a path
    said = "0: PASS" if ref["compare_rc"] == 0 else "1: FAIL ("
    assert f"| {said}" in md and "report:" not in md
    with pytest.raises(SystemExit, match="unknown runs: nope"):
        gate.main([*common, "--runs", "nope"])
