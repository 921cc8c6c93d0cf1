"""What every adapter of a vendor's MLA kernels needs, written once.

An adapter (mlacheck/backends/aiter, aiter_triton, flashinfer, flashmla) imports an optional
library, checks that the installed functions take the keywords it passes, converts the
library's LSE convention and layout to mlacheck's (natural log, [tokens, heads]) and says
which version it ran (`LibraryAdapter`: load once, `version`, `unavailable`). Capabilities
are data on backends.base.Capability.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from mlacheck import sparse_index
from mlacheck.kvcache import PageTable


def signature_problem(function: Callable[..., Any], qualname: str,
                      passed: Sequence[str]) -> str | None:
    """Why calling `function` by keyword with exactly `passed` would fail (None: it fits).

    A passed name the function lacks (renamed / removed), one it takes positionally only,
    or a parameter it requires that the adapter does not pass (a new required argument).
    A function whose signature cannot be inspected is accepted (nothing to check).
    """
    try:
        sig = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    params = sig.parameters
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in passed:
        p = params.get(name)
        if p is None:
            if takes_any_keyword:
                continue
            return f"{qualname} has no parameter {name!r} (renamed or removed)"
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            return f"{qualname} takes {name!r} positionally only"
    for i, (name, p) in enumerate(params.items()):
        if i == 0 and name in ("self", "cls"):  # a method looked up on its class
            continue
        required = p.default is inspect.Parameter.empty and p.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        if required and name not in passed:
            return f"{qualname} requires parameter {name!r}, which this adapter does not pass"
    return None


def nonempty_units(q_lens: Sequence[int]) -> list[int]:
    """The requests / segments a kernel is handed when the empty ones (q_len 0) are left out
    of its call. An empty unit has no query rows, so the others' rows stay where they are and
    nothing is owed for it (its outputs are no rows); its K/V, if any, is simply not read."""
    return [u for u, n in enumerate(q_lens) if n]


def lse_natural(lse: torch.Tensor, base: float = math.e) -> torch.Tensor:
    """An LSE in `base` (2 for FlashInfer's default) as the natural-log LSE, fp32."""
    lse = lse.float()
    return lse if base == math.e else lse * math.log(base)


def lse_empty_rows(lse: torch.Tensor, empty: torch.Tensor,
                   library_value: float = math.inf, *,
                   at_most: float | None = None) -> torch.Tensor:
    """mlacheck's LSE of a row that sees no key is -inf (output 0); FlashMLA's sparse decode
    writes +inf there ("lonely" query rows). `empty` [T] or [T, H] marks the rows that see
    no key (known from the inputs, e.g. a top-k row of -1 only): `library_value` there
    becomes -inf. Elsewhere nothing changes, so a +inf where a row does see keys (an
    overflow) still reaches the judge. `at_most`: a library whose "-inf" is a large negative
    finite value that varies a little (FlashInfer's) is read as -inf at or below it."""
    empty = empty.to(lse.device)
    if empty.dim() < lse.dim():
        empty = empty.reshape(*empty.shape, *([1] * (lse.dim() - empty.dim())))
    hit = empty & ((lse <= at_most) if at_most is not None else (lse == library_value))
    return torch.where(hit, torch.full_like(lse, -math.inf), lse)


def lse_tokens_heads(lse: torch.Tensor, total_q: int, heads: int, *,
                     heads_first: bool = False) -> torch.Tensor:
    """[T, H] from the layouts libraries use: [T, H], [H, T], [T, 1, H, 1] or [B, H, S]
    with B * S == T (read as written: tokens of batch b are rows b*S .. b*S+S-1).

    heads_first: the library documents [H, T] (CK, FlashAttention-3's fwd): transposed even
    when T == H, where the shape alone would read as [T, H].
    """
    if heads_first:
        if tuple(lse.shape) != (heads, total_q):
            raise ValueError(f"LSE of shape {tuple(lse.shape)} is not [{heads} heads, "
                             f"{total_q} tokens]")
        return lse.transpose(0, 1)
    if tuple(lse.shape) == (total_q, heads):
        return lse
    if tuple(lse.shape) == (heads, total_q):
        return lse.transpose(0, 1)
    if lse.dim() == 3 and lse.shape[1] == heads and lse.shape[0] * lse.shape[2] == total_q:
        return lse.transpose(1, 2).reshape(total_q, heads)
    if lse.numel() == total_q * heads:
        return lse.reshape(total_q, heads)
    raise ValueError(f"LSE of shape {tuple(lse.shape)} is not [{total_q} tokens, {heads} heads]")


def topk_to_global_slots(topk: torch.Tensor, qo_indptr: torch.Tensor,
                         table: PageTable) -> torch.Tensor:
    """Logical top-k positions -> global KV-cache slots `page * page_size + offset`.

    topk [T, K] holds, per query token, positions in that token's request (-1 = none);
    AITER's and FlashMLA's sparse kernels want global slots of the pool (they do not
    consult a block table). -1 stays -1. Returns int32 on topk's device.
    """
    dev = topk.device
    idx = topk.detach().long().cpu()
    req = sparse_index.token_requests(qo_indptr.cpu())
    if req.numel() != idx.shape[0]:
        raise ValueError(f"topk has {idx.shape[0]} rows for {req.numel()} query tokens")
    if bool(((idx >= 0) & (idx >= table.kv_lens[req][:, None])).any()):
        raise ValueError("a top-k position is past its request's kv_len")
    block_table, _ = table.to_vllm(pad_value=0)
    slots = sparse_index.to_global_slots(idx, req, block_table, table.page_size)
    if slots.numel() and int(slots.max()) >= 2**31:
        raise ValueError("global slot ids do not fit int32")
    return slots.to(torch.int32).to(dev)


def library_version(distributions: Sequence[str], module: ModuleType | None = None) -> str:
    """'dist version' of the first installed distribution. Where the imported module's own
    __version__ names another release (two installs in one place: the metadata of one, the
    files of another), the module's wins and the metadata is named beside it, so a run is
    never labelled with a release whose code did not run."""
    imported = getattr(module, "__version__", None)
    if imported is not None and _placeholder(str(imported)):
        imported = None  # a build without its version file: the metadata is all there is
    for dist in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            listed = importlib.metadata.version(dist)
            if imported is not None and not _same_release(str(imported), listed):
                return f"{dist} {imported} (its installed metadata says {listed})"
            return f"{dist} {listed}"
    return str(imported if imported is not None else "unknown version")


def _placeholder(version: str) -> bool:
    """A __version__ that names no release: FlashInfer's "0.0.0+unknown" when its _build_meta
    is missing (a source build; flashinfer/version.py:28-30 in 0.7.2.post1). Taken as the
    release it would read as 0.0, and the adapters' release checks would refuse as a 0.2-line
    kernel limit what the installed 0.7 runs."""
    parsed = _parsed(version)
    return "unknown" in version.lower() if parsed is None else not any(parsed.release)


def _same_release(a: str, b: str) -> bool:
    """Equal as PEP 440 versions (0.7.2.post1 == 0.7.2-post1); as strings where unparsable."""
    pa, pb = _parsed(a), _parsed(b)
    return pa == pb if pa is not None and pb is not None else a == b


def _parsed(version: str) -> Any:
    """The PEP 440 version, or None where `version` is not one."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version)
    except InvalidVersion:
        return None


@dataclass
class Loaded:
    """An imported library, its version and what is wrong with the functions the adapter calls."""

    module: ModuleType
    version: str
    problems: dict[str, str] = field(default_factory=dict)  # function -> signature problem

    def function(self, qualname: str) -> Any:
        obj: Any = self.module
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def first_problem(self, functions: Iterable[str]) -> str | None:
        return next((self.problems[f] for f in functions if f in self.problems), None)


def load_library(module: str, *, distributions: Sequence[str], install_hint: str,
                 called: Mapping[str, Sequence[str]], submodules: Sequence[str] = ()
                 ) -> Loaded | str:
    """Import `module` (and `submodules`), check every called function's signature.

    Returns the Loaded library, or a one-line reason (a SKIP reason, never a traceback):
    not installed, or failed to import (a broken build). `called` maps a dotted name under
    the module to the keywords the adapter passes it.
    """
    try:
        top = importlib.import_module(module)
        for sub in submodules:
            importlib.import_module(f"{module}.{sub}")
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == module:
            return f"{module} not installed ({install_hint})"
        return f"{module} failed to import: {type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - a broken install is a one-line SKIP reason
        return f"{module} failed to import: {type(e).__name__}: {e}"[:300]
    loaded = Loaded(top, library_version(distributions, top))
    loaded.problems.update(signature_problems(loaded.function, module, called))
    return loaded


def signature_problems(lookup: Callable[[str], Any], module: str,
                       called: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """function -> why calling it would fail (absent, or `signature_problem`), for every
    function in `called` (dotted name under `module` -> the keywords passed); `lookup`
    finds a dotted name (AttributeError: absent). For adapters that import a library their
    own way; `load_library` uses it too."""
    problems: dict[str, str] = {}
    for qualname, passed in called.items():
        try:
            fn = lookup(qualname)
        except AttributeError as e:  # absent, or (a submodule path) failed to import
            why = str(e) if "failed to import" in str(e) else ""
            problems[qualname] = f"{module} has no {qualname}" + (f" ({why})" if why else "")
            continue
        problem = signature_problem(fn, f"{module}.{qualname}", passed)
        if problem:
            problems[qualname] = problem
    return problems


def cuda_refusal(library: str, sm_major: int | None = None, arch_reason: str = "") -> str | None:
    """Why an NVIDIA library cannot run here (no CUDA GPU; the wrong SM generation), else None."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch ({library} runs on NVIDIA GPUs)"
    if sm_major is not None and torch.cuda.get_device_capability()[0] != sm_major:
        return arch_reason or f"{library} needs an sm_{sm_major}x GPU"
    return None


class LibraryAdapter:
    """The part of a backend that adapts one optional library, written once: the library is
    loaded on first use (importing mlacheck imports nothing optional), `version()` goes into
    every verdict, and `unavailable()` is why not (not installed, a broken build, no fitting
    GPU). A subclass says how it loads (`import_library`) and what the machine needs."""

    _loaded: Loaded | str | None = None

    def import_library(self) -> Loaded | str:
        """`load_library` with the adapter's module and the functions it calls."""
        raise NotImplementedError

    def machine_refusal(self) -> str | None:
        """Why this machine cannot run the library's kernels (e.g. `cuda_refusal`), or None."""
        return None

    def loaded(self) -> Loaded | str:
        """The library, or the one-line reason it cannot be used (asked once)."""
        if self._loaded is None:
            self._loaded = self.import_library()
        return self._loaded

    def version(self) -> str:
        got = self.loaded()
        return got if isinstance(got, str) else got.version

    def unavailable(self) -> str | None:
        got = self.loaded()
        return got if isinstance(got, str) else self.machine_refusal()
