"""`python -m mlacheck.e2e`: problem data, held-out accuracy, and a gate task (GSM8K by
default) run with the e2e model (attention through a named mlacheck backend).

    python -m mlacheck.e2e data DIR [--n-train 200] [--n-test 500]
    python -m mlacheck.e2e eval --model references/e2e_model --backend torch --n 200
    python -m mlacheck.e2e gate --model references/e2e_model --backend torch \\
        --kv fp8_e4m3fn --q fp8_e4m3fn --data-dir DIR --limit 200 --out runs/e2e-fp8.json

Exit status: 0 success, 2 error (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mlacheck.backends.base import Backend
from mlacheck.spec import DEEPSEEK_V3, FORMATS, MLADims, Op, Placement, Quant


def _attention_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, default=Path("references/e2e_model"))
    ap.add_argument(
        "--backend",
        default="torch",
        help="mlacheck backend name or pkg.mod:factory: decode, and prefill unless "
        "--prefill-backend is given",
    )
    ap.add_argument(
        "--prefill-backend",
        default=None,
        help="backend for prefill (default: --backend; e.g. flashmla has no prefill)",
    )
    ap.add_argument("--q", default="bf16", choices=FORMATS, help="q format handed to the backend")
    ap.add_argument("--kv", default="bf16", choices=FORMATS, help="k/v and latent cache format")
    ap.add_argument("--scale", default="amax", choices=("amax", "unit"), help="FP8 scale policy")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--placement", default="shuffled", choices=("packed", "shuffled"))
    ap.add_argument(
        "--tail-poison",
        default="nan",
        choices=("nan", "sentinel"),
        help="what free pages and the unwritten tail of a last page hold: NaN (any read of "
        "them shows) or a large finite value (only a kernel that uses them shows)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (on CPU, 1 is often fastest: tiny per-request ops)",
    )


def _runner(args: argparse.Namespace):  # noqa: ANN202
    from mlacheck.backends.registry import resolve
    from mlacheck.e2e.checkpoint import load_model
    from mlacheck.e2e.runner import AttentionConfig, MLARunner
    from mlacheck.e2e.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    att = AttentionConfig(
        quant=Quant(q=args.q, kv=args.kv, scale=args.scale),
        page_size=args.page_size,
        placement=Placement(kind=args.placement, tail_poison=args.tail_poison),
    )
    backend = resolve(args.backend)
    prefill = resolve(args.prefill_backend) if args.prefill_backend else _fault_prefill(backend)
    model = load_model(args.model, device=args.device, dtype=torch.float32)
    _check_fault_dims(backend, model.config.mla_dims, args.model)
    tok = load_tokenizer(args.model, model.config.bos_token_id, model.config.eos_token_id)
    return MLARunner(model, backend, att, prefill_backend=prefill), tok


def _check_fault_dims(backend: Backend, dims: MLADims, model: Path) -> None:
    """A fault planted in the AITER model (fault:default-softmax-scale) takes DeepSeek's
    attention dims only: said before the run, with the model that has them."""
    from mlacheck.backends.faults import PREFIX, spec_of
    from mlacheck.backends.faults._base import ADAPTER_INNERS
    from mlacheck.e2e.config import E2EError

    if not backend.name.startswith(PREFIX) or spec_of(backend.name).inner not in ADAPTER_INNERS:
        return
    want = DEEPSEEK_V3
    if (dims.kv_lora_rank, dims.qk_rope, dims.qk_nope, dims.v_head) != (
            want.kv_lora_rank, want.qk_rope, want.qk_nope, want.v_head):
        raise E2EError(
            f"{backend.name} is planted in the AITER model, which takes DeepSeek's attention "
            f"dims only (latent {want.kv_lora_rank} + {want.qk_rope}); {model} has "
            f"{dims.kv_lora_rank} + {dims.qk_rope}: use --model "
            "references/e2e_model_deepseek_dims")


def _fault_prefill(backend: Backend) -> Backend | None:
    """A planted fault that acts on decode only (fault:default-softmax-scale) runs its
    prefill on the reference backend, torch, and says so: the fault demonstration runs from
    the command line as `--backend fault:NAME` (the backend a fault is planted in may not
    take the e2e model's dims)."""
    from mlacheck.backends.faults import PREFIX
    from mlacheck.backends.registry import resolve

    if not backend.name.startswith(PREFIX) or Op.PREFILL in backend.capabilities():
        return None
    print(f"note: {backend.name} plants its fault in decode only; prefill runs on torch "
          "(--prefill-backend to choose another)", file=sys.stderr)
    return resolve("torch")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mlacheck.e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="write train.jsonl / test.jsonl (GSM8K format)")
    d.add_argument("dir", type=Path)
    d.add_argument("--n-train", type=int, default=200)
    d.add_argument("--n-test", type=int, default=500)
    d.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("eval", help="held-out accuracy through the runner (no lm-eval)")
    _attention_args(e)
    e.add_argument("--n", type=int, default=200)
    g = sub.add_parser("gate", help="run a gate task through lm-eval with the e2e model")
    _attention_args(g)
    g.add_argument(
        "--task",
        default="gsm8k",
        help="registered gate task (default gsm8k: the format the e2e model is trained on)",
    )
    g.add_argument("--data-dir", type=Path, required=True, help="see `data`")
    g.add_argument("--out", type=Path, required=True, help="run record (JSON)")
    g.add_argument("--limit", type=int, default=None)
    g.add_argument("--num-fewshot", type=int, default=0)
    g.add_argument("--max-gen-toks", type=int, default=128)
    g.add_argument("--label", default=None)
    args = ap.parse_args(argv)

    from mlacheck.backends.registry import BackendError
    from mlacheck.e2e.config import E2EError
    from mlacheck.gate.errors import GateError

    try:
        if args.cmd == "data":
            from mlacheck.e2e.problems import write_gsm8k_dir

            out = write_gsm8k_dir(args.dir, args.n_train, args.n_test, args.seed)
            print(f"wrote {out / 'train.jsonl'} and {out / 'test.jsonl'}")
        elif args.cmd == "eval":
            from mlacheck.e2e.evaluate import evaluate_runner
            from mlacheck.e2e.problems import held_out_set

            runner, tok = _runner(args)
            res = evaluate_runner(runner, tok, held_out_set(args.n), batch_size=args.batch_size)
            print(
                f"held-out accuracy {res.accuracy:.2%} ({res.correct}/{res.n}) with backend "
                f"{runner.backend_label}, {runner.attention.quant.slug}, {res.seconds:.0f} s"
            )
        else:
            from mlacheck.e2e.lm import MLACheckLM
            from mlacheck.gate.lmeval_runner import RunSettings, run_task
            from mlacheck.gate.progress import AnswerProgress
            from mlacheck.gate.task import STRICT
            from mlacheck.gate.tasks import get_task

            task = get_task(args.task)
            t0 = time.perf_counter()
            runner, tok = _runner(args)
            progress = AnswerProgress(task, label=f"e2e {task.name}")
            lm = MLACheckLM(runner, tok, batch_size=args.batch_size, progress=progress)
            label = args.label or f"e2e:{args.model.name}"
            rec = run_task(
                task,
                lm,
                RunSettings(
                    out=args.out,
                    model_label=label,
                    num_fewshot=args.num_fewshot,
                    limit=args.limit,
                    data_dir=args.data_dir,
                    max_gen_toks=args.max_gen_toks,
                    kv_dtype=args.kv,
                    attention_backend=runner.backend_label,
                    extra={
                        "decode_backend": runner.backend.name,
                        "prefill_backend": runner.prefill_backend.name,
                        "q_dtype": args.q,
                        "scale": args.scale,
                        "page_size": str(args.page_size),
                        "placement": runner.attention.placement.slug,
                        "device": args.device,
                        "batch_size": str(args.batch_size),
                    },
                ),
            )
            acc = rec.metrics[STRICT].accuracy
            n = len(rec.samples)
            print(
                f"wrote {args.out}: {task.name} {STRICT} {acc:.2%} on {n} questions with "
                f"{runner.backend_label}, {runner.attention.quant.slug}, page size "
                f"{args.page_size}, {time.perf_counter() - t0:.0f} s"
            )
    except (E2EError, GateError, BackendError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
