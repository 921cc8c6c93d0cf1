"""The GSM8K gate end to end on CPU: a real (small) MLA model, real lm-eval, real statistics.

The committed e2e model (references/e2e_model: DeepSeek-V3 architecture, trained on generated
GSM8K-format problems) answers the held-out questions 0-shot through lm-eval's gsm8k task
(offline data written by mlacheck.e2e.problems), with every attention call of every layer
run as an mlacheck case by a backend:

* baseline: the `torch` backend, bf16 q/kv (the golden-equivalent implementation);
* candidate "fp8": the same backend with FP8 e4m3fn q and KV cache (amax scales, P in FP8):
  a correct, lower-precision attention path -> the gate must PASS it;
* candidate "fault": the decode kernel uses the softmax scale 1/sqrt(576) (AITER's and
  FlashMLA's decode default, DeepSeek's latent width) instead of the model's configured one
  (YaRN mscale^2 / sqrt(qk_nope + qk_rope)) -> the gate must FAIL it, and the report's power
  statement must show that the comparison resolves a drop of that size.

Records, markdown reports and plots go to a temporary directory (or MLACHECK_E2E_REPORT_DIR).
MLACHECK_E2E_MODEL points at another model directory; MLACHECK_E2E_LIMIT changes the number
of questions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.e2e.faults import WrongDecodeScale
from mlacheck.gate.compare import GatePolicy, GateVerdict, compare, power_statement, render_markdown
from mlacheck.gate.record import GateRecord
from mlacheck.gate.task import STRICT
from mlacheck.spec import Quant

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get("MLACHECK_E2E_MODEL", REPO / "references" / "e2e_model"))
# Questions per run: three runs of this many stay around 1-2 minutes on two CPU cores.
LIMIT = int(os.environ.get("MLACHECK_E2E_LIMIT", "150"))
# Non-inferiority margin for this small sample: at n = 150 the paired comparison resolves
# about 1.7 points when no answer flips and 3-3.5 when three or four do (see the power
# statement); even with no flip the lower bound is about -2 points (the gate's default
# margin), so 5 points lets a correct FP8 path through and still fails a broken kernel.
MARGIN = 0.05
# The longest generated answer is 83 characters (= tokens) with its leading space; a model
# that never stops (the faulted one) is cut here.
MAX_GEN_TOKS = 96
BASELINE_ACCURACY_TARGET = 0.80

SKIP_REASON = "no trained e2e model committed yet (references/e2e_model/model.safetensors)"
_HAS_WEIGHTS = any((MODEL_DIR / f).is_file() for f in ("model.safetensors", "model.pt"))

pytestmark = [
    pytest.mark.skipif(not _HAS_WEIGHTS, reason=SKIP_REASON),
    pytest.mark.timeout(900),
]


BF16 = Quant(q="bf16", kv="bf16")
FP8 = Quant(q="fp8_e4m3fn", kv="fp8_e4m3fn", scale="amax")


@dataclass(frozen=True)
class Runs:
    baseline: GateRecord
    fp8: GateRecord
    fault: GateRecord
    report_dir: Path
    decode_calls: dict[str, int]


def _run(
    name: str, backend: TorchBackend, quant: Quant, data: Path, out: Path, calls: dict[str, int]
) -> GateRecord:
    from mlacheck.e2e.checkpoint import load_model
    from mlacheck.e2e.lm import MLACheckLM
    from mlacheck.e2e.runner import AttentionConfig, MLARunner
    from mlacheck.e2e.tokenizer import load_tokenizer
    from mlacheck.gate.lmeval_runner import RunSettings, run_gsm8k

    model = load_model(MODEL_DIR, dtype=torch.float32)
    tok = load_tokenizer(MODEL_DIR, model.config.bos_token_id, model.config.eos_token_id)
    runner = MLARunner(model, backend, AttentionConfig(quant=quant))
    lm = MLACheckLM(runner, tok, batch_size=LIMIT)
    record = run_gsm8k(
        lm,
        RunSettings(
            out=out / f"{name}.json",
            model_label=f"e2e:{MODEL_DIR.name}",
            num_fewshot=0,
            limit=LIMIT,
            data_dir=data,
            max_gen_toks=MAX_GEN_TOKS,
            kv_dtype=quant.kv,
            attention_backend=backend.name,
            extra={"q_dtype": quant.q, "run": name},
        ),
    )
    calls[name] = runner.counts.by_op.get("mla_decode", 0)
    return record


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    pytest.importorskip("lm_eval", reason="needs lm-eval")
    from mlacheck.e2e.problems import write_gsm8k_dir

    # one thread: the backend's per-request attention is many tiny ops, which extra threads
    # only slow down (measured 4x on two shared cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    env_dir = os.environ.get("MLACHECK_E2E_REPORT_DIR")
    out = Path(env_dir) if env_dir else tmp_path_factory.mktemp("e2e-gate")
    out.mkdir(parents=True, exist_ok=True)
    data = write_gsm8k_dir(out / "data", n_train=20, n_test=LIMIT)
    calls: dict[str, int] = {}
    try:
        return Runs(
            baseline=_run("baseline", TorchBackend(), BF16, data, out, calls),
            fp8=_run("fp8", TorchBackend(name="torch-fp8"), FP8, data, out, calls),
            fault=_run(
                "fault",
                WrongDecodeScale(name="torch-decode-scale-1/sqrt(576)"),
                BF16,
                data,
                out,
                calls,
            ),
            report_dir=out,
            decode_calls=calls,
        )
    finally:
        torch.set_num_threads(threads)


def _verdict(runs: Runs, candidate: GateRecord, name: str) -> tuple[GateVerdict, str]:
    verdict = compare(runs.baseline, candidate, GatePolicy(margin=MARGIN))
    md = render_markdown(verdict)
    (runs.report_dir / f"{name}.md").write_text(md, encoding="utf-8")
    try:
        from mlacheck.gate.compare import write_plot

        write_plot(verdict, runs.report_dir / f"{name}.png")
    except ImportError:  # matplotlib is optional
        pass
    return verdict, md


def test_baseline_model_solves_the_held_out_problems(runs: Runs) -> None:
    base = runs.baseline
    assert base.complete and len(base.samples) == LIMIT
    assert base.metric(STRICT).accuracy >= BASELINE_ACCURACY_TARGET, base.metric(STRICT)
    assert base.invalid_count() <= 0.05 * LIMIT
    assert runs.decode_calls["baseline"] > 0 and runs.decode_calls["fault"] > 0


def test_correct_fp8_attention_passes(runs: Runs) -> None:
    verdict, md = _verdict(runs, runs.fp8, "fp8")
    p = verdict.primary
    assert p is not None and p.mode == "paired" and p.n_candidate == LIMIT
    assert verdict.passed, md
    assert all(c.passed for c in verdict.checks)
    assert p.difference.lower > -MARGIN
    assert p.difference.lower <= p.difference.estimate <= p.difference.upper
    assert md.startswith("# GSM8K gate: PASS")
    assert verdict.candidate_meta["kv_dtype"] == "fp8_e4m3fn"


def test_planted_attention_fault_fails_and_the_gate_could_see_it(runs: Runs) -> None:
    verdict, md = _verdict(runs, runs.fault, "fault")
    p = verdict.primary
    assert p is not None and p.mode == "paired"
    assert not verdict.passed, md
    checks = {c.name: c.passed for c in verdict.checks}
    assert checks["non-inferiority"] is False and checks["run complete"] is True
    # the drop is real (the whole two-sided 90% interval lies below 0) ...
    assert p.difference.upper < 0
    assert p.b is not None and p.c is not None and p.b > 3 * max(p.c, 1)
    assert p.mcnemar_midp is not None and p.mcnemar_midp < 0.01
    # ... and the power statement says the gate resolves drops far smaller than this one
    drop = -p.difference.estimate
    assert p.min_detectable_drop < drop
    statement = power_statement(p, verdict.policy)
    assert (
        statement in md and f"resolves a true drop of {100 * p.min_detectable_drop:.2f} pts" in md
    )
    assert md.startswith("# GSM8K gate: FAIL")
