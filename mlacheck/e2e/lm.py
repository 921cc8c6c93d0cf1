"""`MLACheckLM`: the e2e runner as an lm-eval language model (greedy `generate_until`).

This module imports lm-eval; `mlacheck.e2e` itself does not.

    from mlacheck.e2e.lm import MLACheckLM
    lm = MLACheckLM.from_pretrained("references/e2e_model", backend="torch")
    record = run_task(get_task("gsm8k"), lm, RunSettings(out=..., model_label="e2e", ...))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lm_eval.api.model import LM

from mlacheck.backends.base import Backend
from mlacheck.backends.registry import resolve
from mlacheck.e2e.checkpoint import load_model
from mlacheck.e2e.config import E2EError
from mlacheck.e2e.runner import AttentionConfig, MLARunner
from mlacheck.e2e.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer
from mlacheck.spec import Quant

if TYPE_CHECKING:
    from mlacheck.gate.progress import AnswerProgress

DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_GEN_TOKS = 256

_NOT_SCORING = (
    "MLACheckLM only generates text (greedy generate_until, what the accuracy gate uses); "
    "{} is not implemented"
)


class MLACheckLM(LM):  # type: ignore[misc]
    """Greedy batch generation through an `MLARunner` (attention through an mlacheck backend)."""

    def __init__(
        self,
        runner: MLARunner,
        tokenizer: CharTokenizer | HFTokenizer,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        progress: AnswerProgress | None = None,
    ) -> None:
        """`progress`: told of each finished batch (questions done, accuracy so far, ETA)."""
        super().__init__()
        if batch_size < 1:
            raise E2EError("batch_size must be >= 1")
        self.runner = runner
        self.tok = tokenizer
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.max_length = int(runner.config.max_position_embeddings)
        self.progress = progress

    @classmethod
    def from_pretrained(
        cls,
        path: Path | str,
        backend: Backend | str = "torch",
        attention: AttentionConfig | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = DEFAULT_BATCH_SIZE,
        prefill_backend: Backend | str | None = None,
    ) -> MLACheckLM:
        """A model directory (config.json, weights, tokenizer.json) run through `backend`
        (an mlacheck backend or its registry name; prefill through `prefill_backend` when
        given)."""
        model = load_model(path, device=device, dtype=dtype)
        be = resolve(backend) if isinstance(backend, str) else backend
        pbe = resolve(prefill_backend) if isinstance(prefill_backend, str) else prefill_backend
        tok = load_tokenizer(path, model.config.bos_token_id, model.config.eos_token_id)
        runner = MLARunner(model, be, attention or AttentionConfig(), prefill_backend=pbe)
        return cls(runner, tok, batch_size=batch_size)

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> MLACheckLM:
        """lm-eval's `--model_args`: `pretrained=DIR,backend=torch,prefill_backend=torch,
        q=bf16,kv=fp8_e4m3fn,scale=amax,page_size=16,device=cpu,batch_size=64`."""
        args: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in arg_string.split(","))):
            k, _, v = part.partition("=")
            args[k.strip()] = v.strip()
        extra = additional_config or {}
        if "pretrained" not in args:
            raise E2EError("MLACheckLM needs pretrained=<model directory>")
        quant = Quant(
            q=args.get("q", "bf16"), kv=args.get("kv", "bf16"), scale=args.get("scale", "amax")
        )  # type: ignore[arg-type]
        att = AttentionConfig(quant=quant, page_size=int(args.get("page_size", 16)))
        bs = extra.get("batch_size") or args.get("batch_size") or DEFAULT_BATCH_SIZE
        return cls.from_pretrained(
            args["pretrained"],
            backend=args.get("backend", "torch"),
            attention=att,
            device=args.get("device", "cpu"),
            batch_size=int(bs),
            prefill_backend=args.get("prefill_backend"),
        )

    # -- lm-eval API
    def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
        raise NotImplementedError(_NOT_SCORING.format("loglikelihood"))

    def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any:
        raise NotImplementedError(_NOT_SCORING.format("loglikelihood_rolling"))

    def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[tuple[tuple[str, ...], int], list[int]] = {}
        encoded: list[list[int]] = []
        for i, inst in enumerate(requests):
            context, gen_kwargs = inst.args[0], dict(inst.args[1] or {})
            until, max_gen = self._settings(gen_kwargs)
            ids = self.tok.encode(context, add_bos=True)
            keep = max(1, self.max_length - max_gen)
            encoded.append(ids[-keep:])
            groups.setdefault((until, max_gen), []).append(i)
        if self.progress is not None:
            self.progress.begin(len(requests))
        for (until, max_gen), idx in groups.items():
            order = sorted(idx, key=lambda j: -len(encoded[j]))
            for b0 in range(0, len(order), self.batch_size):
                batch = order[b0 : b0 + self.batch_size]
                texts = self.generate([encoded[j] for j in batch], until, max_gen)
                for j, text in zip(batch, texts, strict=True):
                    results[j] = text
                    self.cache_hook.add_partial("generate_until", requests[j].args, text)
                if self.progress is not None:
                    self.progress.answered((getattr(requests[j], "doc", None), text)
                                           for j, text in zip(batch, texts, strict=True))
        return [r if r is not None else "" for r in results]

    # -- helpers
    def _settings(self, gen_kwargs: dict[str, Any]) -> tuple[tuple[str, ...], int]:
        if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature") or 0.0) > 0.0:
            raise E2EError("MLACheckLM decodes greedily: do_sample/temperature > 0 not supported")
        until = gen_kwargs.get("until") or ()
        if isinstance(until, str):
            until = (until,)
        max_gen = int(gen_kwargs.get("max_gen_toks") or self.max_gen_toks)
        return tuple(s for s in until if s), max_gen

    def generate(
        self, prompts: Sequence[list[int]], until: Sequence[str], max_gen: int
    ) -> list[str]:
        """Greedy continuations of encoded prompts, cut at the first stop string."""
        stops = tuple(until)

        def stop(_: int, toks: list[int]) -> bool:
            if not stops:
                return False
            text = self.tok.decode(toks)
            return any(s in text for s in stops)

        outs = self.runner.generate(prompts, max_gen, self.tok.eos_token_id, stop)
        texts = []
        for toks in outs:
            text = self.tok.decode(toks)
            for s in stops:
                text = text.split(s)[0]
            texts.append(text)
        return texts
