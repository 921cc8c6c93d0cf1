"""MLACheckLM: lm-eval's generate_until over the runner, and the gate run end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _e2e_helpers import DEEPSEEK_DIMS, tiny_model

from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.e2e.checkpoint import save_model
from mlacheck.e2e.config import E2EError
from mlacheck.e2e.problems import write_gsm8k_dir
from mlacheck.e2e.runner import AttentionConfig, MLARunner
from mlacheck.e2e.tokenizer import CharTokenizer
from mlacheck.spec import Quant

pytest.importorskip("lm_eval", reason="needs lm-eval")
from lm_eval.api.instance import Instance  # noqa: E402

from mlacheck.e2e.lm import MLACheckLM  # noqa: E402

FP32 = AttentionConfig(quant=Quant(q="fp32", kv="fp32"))


def _inst(i: int, context: str, **gen: Any) -> Instance:
    return Instance("generate_until", {"question": context}, (context, gen), i, ("t", i, 1))


def _lm(batch_size: int = 2) -> MLACheckLM:
    model = tiny_model()  # vocab 100 = the character tokenizer's
    return MLACheckLM(MLARunner(model, TorchBackend(), FP32), CharTokenizer(), batch_size)


def test_generate_until_is_greedy_batched_and_cut_at_stop_strings() -> None:
    lm = _lm()
    tok = lm.tok
    contexts = ["Question: 1 + 1?\nAnswer:", "Hi", "Question: What is 12 * 3?\nAnswer:"]
    free = [tok.decode(t) for t in lm.runner.generate([tok.encode(c) for c in contexts], 12)]
    # what the model says unconstrained, alone, one prompt at a time
    alone = [
        tok.decode(
            MLARunner(lm.runner.model, TorchBackend(), FP32).generate([tok.encode(c)], 12)[0]
        )
        for c in contexts
    ]
    assert free == alone
    stop = free[0][3:5]  # a stop string that occurs in the first answer
    hooked: list[tuple[Any, str]] = []

    class Hook:
        def add_partial(self, attr: str, req: Any, res: str) -> None:
            hooked.append((req, res))

    lm.set_cache_hook(Hook())  # type: ignore[arg-type]
    reqs = [
        _inst(i, c, until=[stop], max_gen_toks=12, do_sample=False) for i, c in enumerate(contexts)
    ]
    out = lm.generate_until(reqs)
    assert out[0] == free[0].split(stop)[0]
    for o, f in zip(out[1:], free[1:], strict=True):
        assert o == f.split(stop)[0]
    assert sorted(r for _, r in hooked) == sorted(out)
    assert lm.generate_until([_inst(0, contexts[2], until="Question:", max_gen_toks=4)]) == [
        free[2][:4].split("Question:")[0]
    ]
    with pytest.raises(E2EError, match="greedily"):
        lm.generate_until([_inst(0, "x", do_sample=True, temperature=0.7)])
    with pytest.raises(NotImplementedError, match="only generates"):
        lm.loglikelihood([])


def test_gate_run_through_lm_eval(tmp_path: Path) -> None:
    """The whole path: lm-eval's gsm8k task (offline data, 0-shot) -> MLACheckLM -> runner
    -> backend; a random model answers nothing right, but every question is answered."""
    from mlacheck.gate.lmeval_runner import RunSettings, run_gsm8k

    data = write_gsm8k_dir(tmp_path / "data", n_train=5, n_test=6)
    model_dir = tmp_path / "model"
    save_model(tiny_model(), model_dir, dtype=torch.float32)
    CharTokenizer().save(model_dir)
    lm = MLACheckLM.from_pretrained(model_dir, backend="torch", attention=FP32, batch_size=4)
    rec = run_gsm8k(
        lm,
        RunSettings(
            out=tmp_path / "run.json",
            model_label="tiny",
            num_fewshot=0,
            data_dir=data,
            max_gen_toks=8,
        ),
    )
    assert rec.complete and len(rec.samples) == 6
    assert rec.metadata.backend == "in-process:MLACheckLM"
    assert lm.runner.counts.prefill == 2  # 6 questions in batches of 4


def test_gate_command_records_which_backend_ran_each_op(tmp_path: Path) -> None:
    """`python -m mlacheck.e2e gate --prefill-backend`: the record names both backends and
    the cache settings (a gate run of a decode-only kernel must say what served prefill)."""
    import json

    from mlacheck.e2e.__main__ import main as e2e_main

    data = write_gsm8k_dir(tmp_path / "data", n_train=3, n_test=3)
    model_dir = tmp_path / "model"
    save_model(tiny_model(), model_dir, dtype=torch.float32)
    CharTokenizer().save(model_dir)
    out = tmp_path / "run.json"
    argv = ["gate", "--model", str(model_dir), "--backend", "torch", "--prefill-backend",
            "torch-split", "--page-size", "4", "--tail-poison", "sentinel", "--data-dir",
            str(data), "--out", str(out), "--max-gen-toks", "4", "--threads", "1"]
    assert e2e_main(argv) == 0
    meta = json.loads(out.read_text())["metadata"]
    assert meta["attention_backend"] == "decode torch / prefill torch-split"
    extra = meta["extra"]
    assert (extra["decode_backend"], extra["prefill_backend"]) == ("torch", "torch-split")
    assert (extra["page_size"], extra["placement"]) == ("4", "shuffled-sentinel")
    assert e2e_main([*argv[:5], "--prefill-backend", "no-such-backend", *argv[7:]]) == 2


def test_gate_command_prints_progress_and_runs_a_decode_fault(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    """Issue 33: the e2e gate was silent for minutes, and `--backend
    fault:default-softmax-scale` (a decode-only fault) aborted mid-run: "does not provide op
    mla_prefill". Each batch prints questions done, accuracy so far and an ETA; a decode-only
    fault runs its prefill on the reference (torch), and says so."""
    import json

    from mlacheck.e2e.__main__ import main as e2e_main

    data = write_gsm8k_dir(tmp_path / "data", n_train=3, n_test=6)
    model_dir = tmp_path / "model"
    save_model(tiny_model(), model_dir, dtype=torch.float32)
    CharTokenizer().save(model_dir)
    out = tmp_path / "run.json"
    small = ["gate", "--model", str(model_dir), "--backend", "fault:default-softmax-scale",
             "--data-dir", str(data), "--out", str(out)]
    assert e2e_main(small) == 2  # planted in the AITER model: DeepSeek's dims only, said first
    assert "use --model references/e2e_model_deepseek_dims" in capsys.readouterr().err
    save_model(tiny_model(**DEEPSEEK_DIMS), model_dir, dtype=torch.float32)
    argv = ["gate", "--model", str(model_dir), "--backend", "fault:default-softmax-scale",
            "--data-dir", str(data), "--out", str(out), "--max-gen-toks", "4", "--threads",
            "1", "--batch-size", "2"]
    assert e2e_main(argv) == 0
    err = capsys.readouterr().err
    assert "note: fault:default-softmax-scale plants its fault in decode only; prefill runs " \
           "on torch" in err
    lines = [line for line in err.splitlines() if line.startswith("e2e gsm8k: ")]
    assert [line.split(" questions")[0] for line in lines] == [
        "e2e gsm8k: 2/6", "e2e gsm8k: 4/6", "e2e gsm8k: 6/6"]
    assert "strict-match 0.0% so far (0 right)" in lines[-1] and lines[-1].endswith("done")
    assert "ETA " in lines[0]
    extra = json.loads(out.read_text())["metadata"]["extra"]
    assert (extra["decode_backend"], extra["prefill_backend"]) == (
        "fault:default-softmax-scale", "torch")


def test_a_backend_without_the_op_is_refused_before_the_run() -> None:
    """Before the model's first question, naming the option that chooses another."""
    from mlacheck.backends.faults import make
    from mlacheck.e2e.runner import MLARunner

    with pytest.raises(E2EError, match="does not provide mla_prefill.*--prefill-backend"):
        MLARunner(tiny_model(), make("default-softmax-scale"))


def test_progress_scores_with_the_tasks_own_filters() -> None:
    from mlacheck.gate.progress import AnswerProgress
    from mlacheck.gate.tasks import get_task

    lines: list[str] = []
    p = AnswerProgress(get_task("gsm8k"), write=lines.append, label="t")
    p.begin(20)
    right, wrong = {"answer": "so #### 42"}, {"answer": "so #### 7"}
    assert p.answered([(right, "The answer is 42.\n#### 42")]) is None  # 5 %: not due
    line = p.answered([(wrong, "#### 42")])
    assert line is not None and line.startswith("t: 2/20 questions (10%), gsm8k strict-match "
                                                 "50.0% so far (1 right)")
    assert lines == [line]
