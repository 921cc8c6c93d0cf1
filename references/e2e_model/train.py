#!/usr/bin/env python3
"""Train the small DeepSeek-V3-architecture model of mlacheck's e2e GSM8K gate.

The model is `mlacheck.e2e.model.MLAModel` (the same code the e2e runner executes), trained
in the MHA form with torch SDPA on generated arithmetic word problems
(`mlacheck.e2e.problems`, train split), 0-shot in lm-eval's gsm8k prompt format
(`Question: ...\\nAnswer: <worked steps>\\n#### N<eos>`, loss on the answer only), AdamW.

    python3 references/e2e_model/train.py --out references/e2e_model --steps 20000 --device cuda
    python3 references/e2e_model/train.py --preset deepseek-dims --time-budget 360 \
        --out references/e2e_model_deepseek_dims --steps 20000 --device cuda --eval-n 100
    python3 references/e2e_model/train.py --out /tmp/e2e-smoke --steps 20 --device cpu

Presets: `small` (the CPU demo, references/e2e_model), `deepseek-dims` (DeepSeek-V3's
attention dims, which production MLA kernels accept: references/e2e_model_deepseek_dims),
`tiny` (CPU checks only).

Training stops at `--steps` or after `--time-budget` seconds, whichever comes first (the
learning-rate schedule follows whichever is further along), so a run on one H100 finishes
in under 8 minutes including data generation and the final evaluation. The script then
writes config.json, model.safetensors (bf16), tokenizer.json and train_log.json into
`--out` (train_log.json right after saving and again after each evaluation, so a run cut
short keeps what it measured), reloads them from disk, and reports the held-out accuracy
measured through the mlacheck e2e runner with the `torch` backend (attention as mlacheck
cases: MHA-form prefill, absorbed decode over a paged latent cache).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.e2e.checkpoint import load_model, save_model
from mlacheck.e2e.config import DEEPSEEK_V3_ROPE_SCALING, ModelConfig
from mlacheck.e2e.evaluate import evaluate_runner, greedy_texts, score_texts
from mlacheck.e2e.model import MLAModel
from mlacheck.e2e.problems import held_out_set, iter_problems, prompt, target
from mlacheck.e2e.runner import AttentionConfig, MLARunner
from mlacheck.e2e.tokenizer import CharTokenizer

MAX_LEN = 256  # tokens per training sequence (the longest generated problem is ~230)

PRESETS: dict[str, dict[str, Any]] = {
    # the committed CPU demo model (references/e2e_model): ~3.3 M parameters, 6.6 MB in bf16
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
    ),
    # DeepSeek-V2/V3's attention dims, the only ones production MLA kernels (FlashMLA,
    # FlashInfer MLA, AITER) accept: a 576-wide latent (512 + 64), q/k 192, v 128; 16 heads
    # (DeepSeek-V3's 128 at tensor parallelism 8); q-LoRA as DeepSeek-V3 (q_a_proj ->
    # q_a_layernorm -> q_b_proj). kv_b_proj alone is 512 x 16 x 256 = 2.1 M parameters per
    # layer, so 3 layers keep the model at 11.4 M parameters, 22.8 MB in bf16
    # (references/e2e_model_deepseek_dims, trained on one H100).
    "deepseek-dims": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=3,
        num_attention_heads=16,
        q_lora_rank=128,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    # CPU checks only
    "tiny": dict(
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
}


# Peak learning rate per preset (--lr overrides). The DeepSeek-dims preset's attention
# matrices have 8x the fan-in of the small one's (kv_b_proj 512, o_proj 2048): half the rate,
# nanoGPT's proven 1e-3 for a ~10 M-parameter model.
PRESET_LR: dict[str, float] = {"small": 2e-3, "tiny": 2e-3, "deepseek-dims": 1e-3}


def model_config(preset: str, tok: CharTokenizer) -> ModelConfig:
    return ModelConfig(
        vocab_size=tok.vocab_size,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=DEEPSEEK_V3_ROPE_SCALING,  # YaRN as DeepSeek-V3: softmax scale x mscale^2
        max_position_embeddings=163840,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        first_k_dense_replace=PRESETS[preset]["num_hidden_layers"],  # all layers dense
        torch_dtype="bfloat16",
        **PRESETS[preset],
    )


def encode_pool(
    tok: CharTokenizer, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n training problems -> ids [n, MAX_LEN] (uint8, padded), lengths [n], answer starts [n]."""
    lut = np.full(128, tok.unk_token_id, dtype=np.uint8)
    for i, c in enumerate(tok.chars):
        if ord(c) < 128:
            lut[ord(c)] = i + 4
    ids = np.zeros((n, MAX_LEN), dtype=np.uint8)
    lens = np.zeros(n, dtype=np.int64)
    starts = np.zeros(n, dtype=np.int64)
    stream = iter_problems("train", seed)
    i = 0
    while i < n:
        p = next(stream)
        pr = prompt(p.question).encode("ascii")
        full = pr + target(p.answer).encode("ascii")
        seq = np.concatenate(
            [[tok.bos_token_id], lut[np.frombuffer(full, dtype=np.uint8)], [tok.eos_token_id]]
        )
        if len(seq) > MAX_LEN:
            continue
        ids[i, : len(seq)] = seq
        lens[i] = len(seq)
        starts[i] = 1 + len(pr)  # first answer token (the space after "Answer:")
        i += 1
    return torch.from_numpy(ids), torch.from_numpy(lens), torch.from_numpy(starts)


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def dense_accuracy(model: MLAModel, tok: CharTokenizer, n: int, batch: int) -> float:
    probs = held_out_set(n)
    was = model.training
    model.eval()

    def gen(b: list[list[int]], m: int) -> list[list[int]]:
        return model.dense_generate(b, m, tok.eos_token_id, tok.pad_token_id)

    texts = greedy_texts(gen, tok, [p.question for p in probs], 120, batch)
    model.train(was)
    return score_texts(probs, texts).accuracy


def write_log(out: Path, log: dict[str, Any], t_start: float) -> float:
    """(Re)write out/train_log.json with the seconds elapsed so far; returns them."""
    log["total_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    return float(log["total_seconds"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--steps", type=int, default=20000, help="maximum optimizer steps")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds of training at most (default: 330 on cuda, unlimited on cpu)",
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--batch-size", type=int, default=None, help="default: 256 cuda, 16 cpu")
    ap.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (default: the preset's)"
    )
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument(
        "--pool",
        type=int,
        default=None,
        help="training problems generated up front (default: min(600k, steps x batch))",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="dense greedy eval on 256 held-out problems every N steps (cuda: 2000)",
    )
    ap.add_argument(
        "--eval-n",
        type=int,
        default=None,
        help="held-out problems for the final runner eval (default: 200 cuda, 16 cpu; 0: none)",
    )
    ap.add_argument(
        "--runner-eval-device",
        default="cpu",
        help="device of the final runner eval (default cpu, one thread: fastest)",
    )
    ap.add_argument(
        "--dense-eval-n",
        type=int,
        default=None,
        help="held-out problems for the final dense reference eval (500 cuda, 16 cpu; 0: none)",
    )
    ap.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    args = ap.parse_args(argv)

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(
            "error: --device cuda but no CUDA device is visible (use --device cpu)", file=sys.stderr
        )
        return 2
    device = torch.device(args.device)
    batch = args.batch_size or (256 if cuda else 16)
    budget = args.time_budget if args.time_budget is not None else (330.0 if cuda else float("inf"))
    log_every = args.log_every or (200 if cuda else 5)
    eval_every = args.eval_every if args.eval_every is not None else (2000 if cuda else 0)
    eval_n = args.eval_n if args.eval_n is not None else (200 if cuda else 16)
    dense_n = args.dense_eval_n if args.dense_eval_n is not None else (500 if cuda else 16)
    lr_peak = args.lr if args.lr is not None else PRESET_LR[args.preset]
    torch.manual_seed(args.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    t_start = time.perf_counter()
    tok = CharTokenizer()
    cfg = model_config(args.preset, tok)
    model = MLAModel(cfg)
    model.init_weights(args.seed)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: preset {args.preset}, {n_params / 1e6:.2f} M parameters, softmax scale "
        f"{cfg.softmax_scale:.6f}, device {device}, torch {torch.__version__}",
        flush=True,
    )

    pool = args.pool or min(600_000, max(args.steps * batch, 1000))
    ids, lens, starts = encode_pool(tok, pool, args.seed)
    lens_cpu = lens
    ids, lens, starts = ids.to(device), lens.to(device), starts.to(device)
    print(
        f"data: {pool} training problems encoded in {time.perf_counter() - t_start:.1f} s",
        flush=True,
    )

    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr_peak,
        betas=(0.9, 0.95),
        fused=cuda,
    )
    fwd = torch.compile(model) if args.compile else model
    gen = torch.Generator().manual_seed(args.seed)  # batches drawn on the CPU: no device sync
    pos = torch.arange(MAX_LEN, device=device)
    warmup = min(args.warmup, max(1, args.steps // 10))
    history: list[dict[str, float]] = []
    t_train = time.perf_counter()
    loss_sum, loss_n, step = torch.zeros((), device=device), 0, 0
    first_loss = last_loss = float("nan")
    while step < args.steps:
        elapsed = time.perf_counter() - t_train
        if elapsed >= budget:
            print(f"time budget of {budget:.0f} s reached at step {step}", flush=True)
            break
        progress = max(step / args.steps, elapsed / budget)
        lr = lr_at(step, progress, lr_peak, warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        rows_cpu = torch.randint(0, pool, (batch,), generator=gen)
        width = int(lens_cpu[rows_cpu].max())
        rows = rows_cpu.to(device, non_blocking=True)
        seq = ids[rows, :width].long()
        inp, tgt = seq[:, :-1], seq[:, 1:]
        # loss on the answer and EOS: target position j predicts token j+1
        mask = (pos[None, 1:width] >= starts[rows, None]) & (pos[None, 1:width] < lens[rows, None])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = fwd(inp)
        loss_tok = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none"
        )
        loss = (loss_tok * mask.reshape(-1)).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_sum += loss.detach()
        loss_n += 1
        if step == 1:
            first_loss = float(loss_sum)
        if step % log_every == 0 or step == args.steps:
            last_loss = float(loss_sum) / loss_n
            rec = {
                "step": step,
                "loss": last_loss,
                "lr": lr,
                "seconds": time.perf_counter() - t_train,
            }
            msg = f"step {step:6d}  loss {last_loss:.4f}  lr {lr:.2e}  {rec['seconds']:.0f} s"
            if eval_every and step % eval_every == 0:
                rec["dense_accuracy_256"] = dense_accuracy(model, tok, 256, 256)
                msg += f"  held-out (dense, 256) {rec['dense_accuracy_256']:.1%}"
            history.append(rec)
            print(msg, flush=True)
            loss_sum, loss_n = torch.zeros((), device=device), 0
    if loss_n:
        last_loss = float(loss_sum) / loss_n
    train_seconds = time.perf_counter() - t_train
    print(
        f"trained {step} steps in {train_seconds:.0f} s; first loss {first_loss:.4f}, "
        f"last loss {last_loss:.4f}",
        flush=True,
    )

    args.out.mkdir(parents=True, exist_ok=True)
    weights = save_model(model, args.out, dtype=torch.bfloat16)
    tok.save(args.out / "tokenizer.json")
    print(f"saved {weights} ({weights.stat().st_size / 1e6:.1f} MB)", flush=True)
    log: dict[str, Any] = {
        "preset": args.preset,
        "parameters": n_params,
        "weights_bytes": weights.stat().st_size,
        "steps": step,
        "batch_size": batch,
        "lr": lr_peak,
        "pool": pool,
        "seed": args.seed,
        "train_seconds": round(train_seconds, 1),
        "first_loss": first_loss,
        "last_loss": last_loss,
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "history": history,
    }
    # written now and again after each evaluation: a run cut short keeps what it measured
    write_log(args.out, log, t_start)

    # -- measured on what was written: reload, run through the mlacheck runner (torch backend)
    if dense_n:
        reloaded = load_model(args.out, device=device, dtype=torch.float32)
        dense = dense_accuracy(reloaded, tok, dense_n, 250)
        print(
            f"held-out accuracy (dense SDPA reference, {dense_n} problems): {dense:.1%}",
            flush=True,
        )
        log.update(heldout_dense_accuracy=dense, heldout_dense_n=dense_n)
        write_log(args.out, log, t_start)
    if eval_n:
        # The runner hands the backend one small attention problem per request, layer and
        # step: on a GPU that is launch-bound (minutes); on one CPU thread it takes seconds.
        eval_device = torch.device(args.runner_eval_device)
        threads = torch.get_num_threads()
        if eval_device.type == "cpu":
            torch.set_num_threads(1)
        runner = MLARunner(
            load_model(args.out, device=eval_device, dtype=torch.float32),
            TorchBackend(),
            AttentionConfig(),
        )
        res = evaluate_runner(runner, tok, held_out_set(eval_n), batch_size=eval_n)
        torch.set_num_threads(threads)
        print(
            f"held-out accuracy through the mlacheck runner (torch backend, bf16 q/kv, paged "
            f"latent cache, {eval_device.type}; {res.n} problems): {res.accuracy:.1%} in "
            f"{res.seconds:.0f} s",
            flush=True,
        )
        for q, text, ok in res.samples[:3]:
            print(f"  [{'ok' if ok else 'WRONG'}] {q}\n      -> {text.strip()!r}")
        log.update(heldout_runner_accuracy=res.accuracy, heldout_runner_n=res.n)
    total = write_log(args.out, log, t_start)
    print(f"total {total:.0f} s; wrote {args.out / 'train_log.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
