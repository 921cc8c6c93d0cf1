"""The backend contract: what an MLA implementation declares and how it is called.

An implementation declares, per op it provides, a `Capability`: the matrix asks
`capability.why_not(case, device)` and an unsupported case becomes a SKIP that names the
capability that ruled it out (never silently dropped). `run` receives the case and its
inputs (see mlacheck.inputs) and returns an `Output` normalised to mlacheck's conventions:
out [T, H, Dv], LSE [T, H] in natural log (or None), in the order of the case's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

from mlacheck.inputs import Inputs
from mlacheck.spec import Case


@dataclass(frozen=True)
class Range:
    lo: int = 1
    hi: int | None = None

    def __contains__(self, x: object) -> bool:
        return isinstance(x, int) and x >= self.lo and (self.hi is None or x <= self.hi)

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi if self.hi is not None else 'inf'}"


ANY = None  # a capability field left as ANY accepts every value

# A SKIP that is the adapter's choice, not the kernel's limit (an entry point not wired, a
# format not yet measured) says so with this marker in its reason: the coverage tables
# (mlacheck.report.coverage) count it as SKIP-by-adapter. Every other SKIP of a real backend
# is a kernel limit, its reason read from the kernel's source or measured.
ADAPTER_CHOICE = "adapter:"


def adapter_choice(why: str) -> str:
    """A SKIP reason that is the adapter's choice (see ADAPTER_CHOICE)."""
    return f"{ADAPTER_CHOICE} {why}"


# A SKIP that is the machine's (the library missing, no fitting GPU, a prebuilt module not
# installed): `Backend.unavailable()` reasons, or an op's refusal that only the machine's setup
# decides. The coverage tables count it as SKIP-by-machine, neither kernel nor adapter.
UNAVAILABLE = "unavailable:"


def machine_setup(why: str) -> str:
    """A SKIP reason that is the machine's (see UNAVAILABLE)."""
    return f"{UNAVAILABLE} {why}"

# A per-case rule no single field can say: None when the case is fine, else the reason.
CaseRule = Callable[[Case], "str | None"]


@dataclass(frozen=True)
class Capability:
    """What one op of a backend supports. ANY (None) means unrestricted."""

    q_formats: Collection[str] | None = ANY
    kv_formats: Collection[str] | None = ANY
    scale_policies: Collection[str] | None = ANY
    per_token_scales: bool = False
    page_sizes: Collection[int] | Range | None = ANY
    # KV pool layouts (mlacheck.layouts names) of paged prefill and of decode pools; ANY
    # suits a backend that reads pools only through KVPool.gather / .linear()
    layouts: Collection[str] | None = ANY
    head_counts: Collection[int] | Range | None = ANY
    q_len: Range = Range(1, None)
    causal: Collection[bool] = (True, False)
    lse: bool = True
    soft_cap: bool = False
    devices: Collection[str] = ("cpu", "cuda")
    max_batch: int | None = None
    max_topk: int | None = None
    # Empty requests / segments (q_len 0: repeated qo_indptr / cu_seqlens entries, as padded
    # batch slots give). Off unless the implementation is known to skip them correctly.
    empty_requests: bool = False
    # The op cannot run here at all (an API that does not fit, a chip without the kernel):
    # the reason, given for every case.
    refusal: str | None = None
    # (q, kv) format combinations the kernels exist for (ANY: every q x kv format allowed).
    format_pairs: Collection[tuple[str, str]] | None = ANY
    heads_multiple_of: int = 1
    # Every request of a batch must have the same q_len (kernels that reshape q by q_len).
    uniform_q_len: bool = False
    rules: tuple[CaseRule, ...] = ()
    # Why a restricted field is restricted, by field name ("scale_policies": "the kernel's
    # cache keeps ... in bf16"): appended to the SKIP reason that field gives, so the SKIP
    # says the kernel's reason as well as the value it refused.
    reasons: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.reasons) - {f.name for f in fields(self)}
        if unknown:  # a misspelt key would never be shown
            raise ValueError(f"Capability.reasons names no field: {', '.join(sorted(unknown))}")

    def why_not(self, case: Case, device: str) -> str | None:
        """None if supported, else a one-line reason naming the capability."""
        if self.refusal:
            return self.refusal
        dev = torch.device(device).type
        if dev not in self.devices:
            return f"device {dev} not supported (devices: {', '.join(self.devices)})"
        q = case.quant
        # (capability field, ok, reason)
        checks: list[tuple[str, bool, str]] = [
            ("q_formats", _ok(q.q, self.q_formats), f"q format {q.q} not in {_fmt(self.q_formats)}"),
            ("kv_formats", _ok(q.kv, self.kv_formats),
             f"kv format {q.kv} not in {_fmt(self.kv_formats)}"),
            ("format_pairs", _ok((q.q, q.kv), self.format_pairs),
             f"q/kv formats {q.q}/{q.kv} not in {_fmt(self.format_pairs)}"),
            ("heads_multiple_of", case.num_heads % self.heads_multiple_of == 0,
             f"{case.num_heads} heads not a multiple of {self.heads_multiple_of}"),
            ("scale_policies", not q.is_fp8 or _ok(q.scale, self.scale_policies),
             f"fp8 scale policy {q.scale} not in {_fmt(self.scale_policies)}"),
            ("per_token_scales", not q.per_token or self.per_token_scales,
             "per-token scales not supported"),
            ("head_counts", _ok(case.num_heads, self.head_counts),
             f"{case.num_heads} heads not in {_fmt(self.head_counts)}"),
            ("empty_requests", self.empty_requests or not case.has_empty,
             "empty requests/segments (q_len 0) not supported"),
            # the mask, the LSE and the soft cap (a prefill's fields; the same facts with
            # their "none" values on the other cases: causal, no LSE required, no cap)
            ("causal", case.causal in self.causal, f"causal={case.causal} not supported"),
            ("lse", not case.requires_lse or self.lse, "LSE output not supported"),
            ("soft_cap", not case.soft_cap or self.soft_cap, "soft cap not supported"),
        ]
        paging = case.paging
        if paging is not None:
            checks += [
                ("page_sizes", _ok(paging.page_size, self.page_sizes),
                 f"page size {paging.page_size} not in {_fmt(self.page_sizes)}"),
                ("layouts", _ok(paging.layout, self.layouts),
                 f"layout {paging.layout} not in {_fmt(self.layouts)}"),
            ]
        checks += [
            ("q_len", all(q in self.q_len for q in case.q_lengths if q),
             f"{case.unit_name} q_len {case.max_q_len} outside {self.q_len}"),
            ("max_batch", self.max_batch is None or len(case.units) <= self.max_batch,
             f"{len(case.units)} {case.unit_name}s > max batch {self.max_batch}"),
            ("uniform_q_len",
             not self.uniform_q_len or len({q for q in case.q_lengths if q}) <= 1,
             "mixed q_len in one batch (the kernel takes one q_len per batch)"),
        ]
        if case.topk is not None:  # sparse decode and the sparse-pipeline cases
            checks.append(("max_topk", self.max_topk is None or case.topk <= self.max_topk,
                           f"topk {case.topk} > max {self.max_topk}"))
        for name, ok, reason in checks:
            if not ok:
                why = self.reasons.get(name)
                return f"{reason} ({why})" if why else reason
        for rule in self.rules:
            why = rule(case)
            if why:
                return why
        return None


def _ok(value: Any, allowed: Collection[Any] | Range | None) -> bool:
    return allowed is None or value in allowed


def _fmt(allowed: Collection[Any] | Range | None) -> str:
    if allowed is None:
        return "any"
    if isinstance(allowed, Range):
        return str(allowed)
    return "{" + ", ".join("/".join(a) if isinstance(a, tuple) else str(a)
                           for a in sorted(allowed, key=str)) + "}"


@dataclass
class Output:
    """A backend's result, normalised: out [T, H, Dv]; lse [T, H] natural log or None (the
    sparse-pipeline ops: `out` is their primary output, see mlacheck.pipeline_judge).

    `metadata` carries what the backend used that the judge can validate (e.g. AITER's
    persistent-schedule buffers under key "persistent"); `wrote_into_guarded` says the
    kernel wrote into `inputs.out` (so guard rows are meaningful).
    """

    out: torch.Tensor
    lse: torch.Tensor | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    wrote_into_guarded: bool = False
    # Named secondary outputs an op has beside `out` (the sparse-pipeline ops: "max_logits"
    # [T, H] of sparse prefill, "slots" [T, topk] the composed path attended to, "indptr" of
    # a ragged index buffer), normalised like `out`.
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """What mlacheck calls. See docs/backends.md for a minimal example."""

    name: str

    def capabilities(self) -> dict[str, Capability]:
        """Per op name ("mla_prefill", "mla_decode", "mla_sparse_decode", "paged_prefill")."""
        ...

    def unavailable(self) -> str | None:
        """None when usable here, else why not (e.g. 'aiter not installed'): a SKIP reason."""
        ...

    def run(self, case: Case, inputs: Inputs) -> Output: ...


def skip_reason(backend: Backend, case: Case, device: str) -> str | None:
    """Why this backend cannot run this case here (None = it can)."""
    # The reason alone: reports and the terminal already group skips by backend and op.
    why = backend.unavailable()
    if why:
        return machine_setup(why)
    cap = backend.capabilities().get(case.op)
    if cap is None:
        return f"does not provide op {case.op}"
    return cap.why_not(case, device)
