"""Run a gate task through lm-eval and turn the result into a :class:`GateRecord` (side effects).

Two ways to name the model under test:

* a :class:`ModelSpec` - an lm-eval registry name and its arguments; for a served model,
  :func:`local_completions_spec` builds the ``local-completions`` spec (OpenAI-compatible
  ``/v1/completions`` endpoint, prompts sent as text, no tokenizer needed);
* an ``lm_eval.api.model.LM`` instance - the in-process hook: any object implementing
  ``generate_until`` (e.g. the small MLA model runner of ``mlacheck.e2e``).

Nothing measured is lost: every response is appended to ``<record>.responses.jsonl`` as it
arrives (through lm-eval's cache hook, which API models call per request; for other LMs when
``generate_until`` returns), and if the run fails a partial record (status ``aborted``,
scored with the task's mirror of lm-eval's filters, :class:`mlacheck.gate.task.GateTask`) is
written before the error is raised. lm-eval aborts a run at the first request that still
fails after its retries; the requests then left without a response are counted as failed.

lm-eval is imported lazily: importing this module does not need it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import logging
import os
import platform
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata as _md
from pathlib import Path
from typing import IO, Any

import yaml

import mlacheck
from mlacheck.gate.errors import GateError
from mlacheck.gate.record import (
    SCORED_BY_LMEVAL,
    SCORED_BY_MIRROR,
    STATUS_ABORTED,
    GateRecord,
    MetricSummary,
    RunMetadata,
    SampleRecord,
    lmeval_role_metrics,
    metrics_from_samples,
)
from mlacheck.gate.task import FLEXIBLE, STRICT, GateTask, is_degenerate, protocol_sha256
from mlacheck.gate.tasks import DEFAULT_TASK, get_task
from mlacheck.gate.tasks.gsm8k import GSM8K

# Generation budget per answer: lm-eval's default max_gen_toks for API and HF models. Made
# explicit so that it is part of the protocol hash and identical for every backend.
DEFAULT_MAX_GEN_TOKS = 256
# Concurrent requests to the server (lm-eval num_concurrent); throughput only, no effect on
# greedy outputs of a batch-invariant server.
DEFAULT_NUM_CONCURRENT = 8
# lm-eval's own defaults for API models: attempts per request and per-request timeout.
DEFAULT_MAX_RETRIES = 3
DEFAULT_REQUEST_TIMEOUT_S = 300
# The preflight completion (1 token) must answer within this; a cold server may need a while.
PREFLIGHT_TIMEOUT_S = 60.0
PREFLIGHT_PROMPT = "Question: What is 1 + 1?\nAnswer:"
# Error messages carried into records and printed by the CLI are cut to this length.
ERROR_MESSAGE_MAX_CHARS = 300

LOCAL_COMPLETIONS = "local-completions"
TOKENIZER_BACKENDS = ("none", "huggingface", "tiktoken", "remote")

RESPONSES_SUFFIX = ".responses.jsonl"


@dataclass(frozen=True)
class ModelSpec:
    """An lm-eval model by registry name with constructor arguments."""

    name: str
    args: Mapping[str, Any]


@dataclass(frozen=True)
class RunSettings:
    """What to evaluate and what to write down about it."""

    out: Path  # record path; responses go to <out>.responses.jsonl
    model_label: str  # how the model is named in the record
    num_fewshot: int | None = None  # None: the task's own (GSM8K: 5, the figure reports use)
    limit: int | None = None
    data_dir: Path | None = None  # offline data (the task's data files); None: HF hub
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
    base_url: str | None = None
    server_args: str | None = None
    kv_dtype: str | None = None
    attention_backend: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)


def responses_path(record_path: Path) -> Path:
    return record_path.with_name(record_path.name.removesuffix(".json") + RESPONSES_SUFFIX)


def one_line(text: str) -> str:
    flat = " ".join(str(text).split())
    if len(flat) > ERROR_MESSAGE_MAX_CHARS:
        flat = flat[: ERROR_MESSAGE_MAX_CHARS - 3] + "..."
    return flat


def describe_exception(exc: BaseException) -> str:
    msg = one_line(str(exc))
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


# --- server ------------------------------------------------------------------------------


def normalize_completions_url(url: str) -> str:
    """``http://h:p`` or ``http://h:p/v1`` -> ``http://h:p/v1/completions``; a URL whose path
    already names an endpoint is kept as is."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise GateError(f"server URL must be http(s)://host:port[/v1/completions], got {url!r}")
    path = parts.path.rstrip("/")
    if path in ("", "/v1"):
        path = "/v1/completions"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def preflight(base_url: str, model: str, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
    """Ask the server for a 1-token completion; raise a one-line GateError if it does not
    answer, rejects the request, or answers with something that is not a completion."""
    payload = json.dumps(
        {"model": model, "prompt": PREFLIGHT_PROMPT, "max_tokens": 1, "temperature": 0}
    ).encode()
    headers = {"Content-Type": "application/json"}
    api_key = os.environ.get("OPENAI_API_KEY")  # lm-eval's local-completions sends it too
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(base_url, data=payload, headers=headers, method="POST")
    # No proxies, like lm-eval's concurrent client (aiohttp without trust_env).
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace") if exc.fp else ""
        raise GateError(
            f"server at {base_url} rejected a test completion for model {model!r}: "
            f"HTTP {exc.code} {one_line(detail)[:200]}"
        ) from None
    except urllib.error.URLError as exc:
        raise GateError(f"cannot reach server at {base_url}: {one_line(str(exc.reason))}") from None
    except (TimeoutError, OSError) as exc:
        raise GateError(f"cannot reach server at {base_url}: {describe_exception(exc)}") from None
    try:
        data = json.loads(body)
        ok = isinstance(data, dict) and isinstance(data.get("choices"), list) and data["choices"]
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise GateError(
            f"server at {base_url} answered a test completion with something that is not an "
            f"OpenAI completion: {one_line(body.decode('utf-8', 'replace'))[:200]}"
        )


def local_completions_spec(
    base_url: str,
    model: str,
    *,
    num_concurrent: int = DEFAULT_NUM_CONCURRENT,
    tokenizer: str | None = None,
    tokenizer_backend: str = "none",
    max_retries: int = DEFAULT_MAX_RETRIES,
    timeout_s: int = DEFAULT_REQUEST_TIMEOUT_S,
) -> ModelSpec:
    """lm-eval ``local-completions`` against an OpenAI-compatible server. Prompts are sent
    as text (``tokenized_requests=False``); a tokenizer is optional (only used by lm-eval for
    the EOS string) and loaded with ``tokenizer_backend`` if given."""
    if tokenizer_backend not in TOKENIZER_BACKENDS:
        raise GateError(
            f"tokenizer backend must be one of {', '.join(TOKENIZER_BACKENDS)}, "
            f"got {tokenizer_backend!r}"
        )
    if tokenizer is not None and tokenizer_backend == "none":
        tokenizer_backend = "huggingface"
    if num_concurrent < 1 or max_retries < 1 or timeout_s < 1:
        raise GateError("num_concurrent, max_retries and timeout must be >= 1")
    args: dict[str, Any] = {
        "model": model,
        "base_url": normalize_completions_url(base_url),
        "num_concurrent": num_concurrent,
        "max_retries": max_retries,
        "timeout": timeout_s,
        "tokenized_requests": False,
        "tokenizer_backend": tokenizer_backend,
    }
    if tokenizer is not None:
        args["tokenizer"] = tokenizer
    return ModelSpec(LOCAL_COMPLETIONS, args)


# --- recording ---------------------------------------------------------------------------


class _ResponseLog:
    """Collects responses per document and appends each to a JSON-lines file at once."""

    def __init__(self, stream: IO[str], task: GateTask) -> None:
        self._stream = stream
        self._task = task
        self._by_context: dict[str, list[Any]] = {}
        self.planned: list[Any] = []  # lm-eval Instances, in request order
        self.answered: dict[int, tuple[Mapping[str, Any], str]] = {}

    def expect(self, requests: Sequence[Any]) -> None:
        for inst in requests:
            self.planned.append(inst)
            self._by_context.setdefault(inst.args[0], []).append(inst)

    def on_partial(self, req: Any, res: Any) -> None:
        """Cache-hook callback: ``req`` is ``(context, gen_kwargs)``."""
        if not isinstance(res, str):
            return
        try:
            context = req[0]
        except (TypeError, IndexError):
            return
        for inst in self._by_context.get(context, ()):
            if inst.doc_id not in self.answered:
                self.add(inst, res)
                return

    def add(self, inst: Any, text: str) -> None:
        if inst.doc_id in self.answered:
            return
        self.answered[inst.doc_id] = (inst.doc, text)
        line = {"doc_id": inst.doc_id, "doc_hash": self._task.hash_doc(inst.doc), "response": text}
        self._stream.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._stream.flush()


def _recording_lm(inner: Any, log: _ResponseLog) -> Any:
    """Wrap an lm-eval LM so that every response reaches ``log`` as soon as it exists."""
    from lm_eval.api.model import LM, CacheHook

    class _Hook(CacheHook):
        def __init__(self, callback: Callable[[Any, Any], None]) -> None:
            super().__init__(None)
            self._callback = callback

        def add_partial(self, attr: str, req: Any, res: Any) -> None:
            if attr == "generate_until":
                self._callback(req, res)

    class RecordingLM(LM):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        @property
        def rank(self) -> int:
            return int(getattr(inner, "rank", 0))

        @property
        def world_size(self) -> int:
            return int(getattr(inner, "world_size", 1))

        def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
            raise NotImplementedError("the gate only generates")

        def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any:
            raise NotImplementedError("the gate only generates")

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list[str]:
            log.expect(requests)
            inner.set_cache_hook(_Hook(log.on_partial))
            outputs = inner.generate_until(requests)
            if len(outputs) != len(requests):
                raise RuntimeError(
                    f"model returned {len(outputs)} generations for {len(requests)} requests"
                )
            for inst, text in zip(requests, outputs, strict=True):
                log.add(inst, text if isinstance(text, str) else "")
            return outputs

    return RecordingLM()


# --- records -----------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    out = {"mlacheck": mlacheck.__version__, "python": platform.python_version()}
    for dist in ("lm_eval", "torch", "datasets"):
        with contextlib.suppress(_md.PackageNotFoundError):
            out[dist] = _md.version(dist)
    return out


def _metadata(settings: RunSettings, backend: str, data_source: str, proto: str) -> RunMetadata:
    return RunMetadata(
        model=settings.model_label,
        backend=backend,
        base_url=settings.base_url,
        server_args=settings.server_args,
        kv_dtype=settings.kv_dtype,
        attention_backend=settings.attention_backend,
        num_fewshot=settings.num_fewshot,
        limit=settings.limit,
        max_gen_toks=settings.max_gen_toks,
        data_source=data_source,
        protocol_sha256=proto,
        versions=_versions(),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        extra=dict(settings.extra),
    )


def score_response(
    doc_id: int, doc: Mapping[str, Any], response: str, task: GateTask | None = None
) -> SampleRecord:
    """Score one response of ``task`` (default: the default task) with its mirror of lm-eval's
    filters and metric (partial records)."""
    task = task or get_task(DEFAULT_TASK)
    strict = task.extract(response, STRICT)
    flexible = task.extract(response, FLEXIBLE)
    answer = doc[task.answer_field]
    return SampleRecord(
        doc_id=doc_id,
        doc_hash=task.hash_doc(doc),
        target=task.gold_of(doc),
        strict_correct=task.exact_match(strict, answer),
        flexible_correct=task.exact_match(flexible, answer),
        strict_answer=strict,
        flexible_answer=flexible,
        no_number=task.found_nothing(flexible),
        degenerate=is_degenerate(response),
    )


def samples_from_lmeval(
    task: GateTask, logged: Sequence[Mapping[str, Any]]
) -> tuple[SampleRecord, ...]:
    """Per-document outcomes from lm-eval's logged samples (one entry per doc and filter)."""
    by_doc: dict[int, dict[str, Mapping[str, Any]]] = {}
    for entry in logged:
        by_doc.setdefault(int(entry["doc_id"]), {})[entry["filter"]] = entry
    out = []
    for doc_id in sorted(by_doc):
        entries = by_doc[doc_id]
        missing = set(task.role_filters.values()) - set(entries)
        if missing:
            raise GateError(f"lm-eval logged no {sorted(missing)} result for doc {doc_id}")
        strict, flexible = (entries[task.role_filters[role]] for role in (STRICT, FLEXIBLE))
        doc = strict["doc"]
        response = strict["resps"][0][0]
        out.append(
            SampleRecord(
                doc_id=doc_id,
                doc_hash=task.hash_doc(doc),
                target=task.gold_of(doc),
                strict_correct=float(strict["exact_match"]) == 1.0,
                flexible_correct=float(flexible["exact_match"]) == 1.0,
                strict_answer=str(strict["filtered_resps"][0]),
                flexible_answer=str(flexible["filtered_resps"][0]),
                no_number=task.found_nothing(str(flexible["filtered_resps"][0])),
                degenerate=is_degenerate(response if isinstance(response, str) else ""),
            )
        )
    return tuple(out)


def metrics_from_lmeval(
    task: GateTask, results: Mapping[str, Any], samples: Sequence[SampleRecord]
) -> dict[str, MetricSummary]:
    """lm-eval's accuracies of ``task``, checked against the per-sample outcomes."""
    n = len(samples)
    out = lmeval_role_metrics(task, results[task.name], n)
    for role, summary in out.items():
        mean = sum(s.correct(role) for s in samples) / n if n else 0.0
        if abs(mean - summary.accuracy) > 1e-9:
            raise GateError(
                f"lm-eval reports {role} accuracy {summary.accuracy} but its samples average "
                f"to {mean}"
            )
    return out


# --- the run -----------------------------------------------------------------------------


class _DropOrphanedTaskErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Task exception was never retrieved")


@contextlib.contextmanager
def _quiet_orphaned_asyncio_tasks() -> Iterator[None]:
    """When one request of lm-eval's concurrent API client fails, the others end as asyncio
    tasks whose errors nobody retrieves; asyncio logs each with a traceback whenever the
    garbage collector gets to them (possibly long after the run, in the middle of unrelated
    code). They repeat the failure already reported, so collect them here, silently."""
    logger = logging.getLogger("asyncio")
    quiet = _DropOrphanedTaskErrors()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        gc.collect()
        logger.removeFilter(quiet)


@contextlib.contextmanager
def _quiet_git_probe() -> Iterator[None]:
    """lm-eval records `git describe` of the working directory; outside a git checkout git
    prints `fatal: not a git repository` on our stderr. Ask git the same, quietly."""
    import lm_eval.evaluator as evaluator

    original = evaluator.get_git_commit_hash

    def quiet() -> str | None:
        try:
            done = subprocess.run(["git", "describe", "--always"], capture_output=True,
                                  text=True, check=True)
            return done.stdout.strip()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return None

    evaluator.get_git_commit_hash = quiet
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def _make_lm(model: Any) -> tuple[Any, str]:
    if isinstance(model, ModelSpec):
        from lm_eval.api.registry import get_model

        try:
            args = dict(model.args)
            extra = {} if "batch_size" in args else {"batch_size": 1}
            lm = get_model(model.name).create_from_arg_obj(args, extra)
        except Exception as exc:  # lm-eval raises anything from constructors
            raise GateError(
                f"cannot create lm-eval model {model.name!r}: {describe_exception(exc)}"
            ) from None
        return lm, model.name
    from lm_eval.api.model import LM

    if not isinstance(model, LM):
        raise GateError(f"model must be a ModelSpec or an lm_eval LM, got {type(model).__name__}")
    return model, f"in-process:{type(model).__name__}"


def run_gsm8k(model: ModelSpec | Any, settings: RunSettings) -> GateRecord:
    """:func:`run_task` on GSM8K (the gate's Python API before tasks were registered)."""
    return run_task(GSM8K, model, settings)


def run_task(task: GateTask, model: ModelSpec | Any, settings: RunSettings) -> GateRecord:
    """Evaluate ``task`` with lm-eval, write the record to ``settings.out`` and return it.

    Raises GateError (one line) on bad settings or when the run fails; if any response was
    received before the failure, a partial record (status ``aborted``) is written first.
    """
    shots = task.num_fewshot if settings.num_fewshot is None else settings.num_fewshot
    settings = replace(settings, num_fewshot=shots)  # the record says how many were used
    if shots < 0:
        raise GateError("num_fewshot must be >= 0")
    if settings.limit is not None and settings.limit < 1:
        raise GateError("limit must be >= 1")
    if settings.max_gen_toks < 1:
        raise GateError("max_gen_toks must be >= 1")
    if settings.data_dir is not None:
        data_source = task.check_data_dir(settings.data_dir, shots)
    else:
        data_source = task.hub_source
    cfg = task.lm_eval_config(settings.data_dir)
    proto = protocol_sha256(cfg, shots, settings.max_gen_toks)

    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise GateError(
            f"the {task.title} gate needs lm-eval ({exc}); install mlacheck[eval]"
        ) from None

    inner, backend = _make_lm(model)
    metadata = _metadata(settings, backend, data_source, proto)
    out = Path(settings.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    with (
        tempfile.TemporaryDirectory(prefix=f"mlacheck-{task.name}-") as task_dir,
        responses_path(out).open("w", encoding="utf-8") as stream,
    ):
        # the generation budget goes in the task's own generation_kwargs: passed as lm-eval's
        # gen_kwargs it warns on every run ("Ensure 'do_sample=True'...") for greedy decoding
        run_cfg = {**cfg, "generation_kwargs": {**cfg["generation_kwargs"],
                                                "max_gen_toks": settings.max_gen_toks}}
        (Path(task_dir) / f"{task.name}.yaml").write_text(
            yaml.safe_dump(run_cfg, sort_keys=False), encoding="utf-8"
        )
        log = _ResponseLog(stream, task)
        failure: str | None = None
        results: Mapping[str, Any] | None = None
        with _quiet_orphaned_asyncio_tasks(), _quiet_git_probe():
            try:
                results = simple_evaluate(
                    model=_recording_lm(inner, log),
                    tasks=[task.name],
                    num_fewshot=shots,
                    limit=settings.limit,
                    log_samples=True,
                    task_manager=TaskManager(include_path=task_dir, include_defaults=False),
                )
            except (Exception, KeyboardInterrupt) as exc:
                failure = (
                    "interrupted" if isinstance(exc, KeyboardInterrupt) else describe_exception(exc)
                )
        if failure is not None:
            if not log.planned:
                raise GateError(f"{task.name} run failed before any request was sent: {failure}")
            _partial_record(task, log, metadata, failure).save(out)
            raise GateError(
                f"{task.name} run aborted after {len(log.answered)}/{len(log.planned)} responses "
                f"({failure}); partial record written to {out}"
            )

    if results is None:
        raise GateError("lm-eval returned no results (not rank 0?)")
    samples = samples_from_lmeval(task, results["samples"][task.name])
    record = GateRecord(
        metadata=metadata,
        metrics=metrics_from_lmeval(task, results["results"], samples),
        n_planned=int(results["n-samples"][task.name]["effective"]),
        samples=samples,
        scored_by=SCORED_BY_LMEVAL,
        task=task.name,
    )
    record.save(out)
    return record


def _partial_record(
    task: GateTask, log: _ResponseLog, metadata: RunMetadata, reason: str
) -> GateRecord:
    samples = tuple(
        score_response(doc_id, doc, text, task)
        for doc_id, (doc, text) in sorted(log.answered.items())
    )
    planned_docs = {inst.doc_id for inst in log.planned}
    return GateRecord(
        metadata=metadata,
        metrics=metrics_from_samples(samples),
        n_planned=len(planned_docs),
        samples=samples,
        status=STATUS_ABORTED,
        error=reason,
        failed_requests=len(planned_docs) - len(samples),
        scored_by=SCORED_BY_MIRROR,
        task=task.name,
    )
