"""The backend toolkit's LSE normalisation and signature checks, used by every adapter."""

from __future__ import annotations

import math
import types

import pytest
import torch

from mlacheck.backends.toolkit import (
    lse_empty_rows,
    lse_natural,
    lse_tokens_heads,
    signature_problems,
)


def test_lse_natural_converts_base_2_and_keeps_natural_log() -> None:
    x = torch.tensor([[0.5, -3.0]], dtype=torch.bfloat16)
    assert lse_natural(x).dtype == torch.float32
    assert torch.equal(lse_natural(x), x.float())
    assert torch.allclose(lse_natural(x, 2.0), x.float() * math.log(2.0))


@pytest.mark.parametrize("layout", ["TH", "HT", "T1H1", "TH1", "BHS"])
def test_every_library_layout_becomes_tokens_by_heads(layout: str) -> None:
    t, h = 6, 4
    want = torch.arange(t * h, dtype=torch.float32).reshape(t, h)
    given = {"TH": want, "HT": want.T, "T1H1": want.reshape(t, 1, h, 1),
             "TH1": want.reshape(t, h, 1),
             "BHS": want.reshape(2, 3, h).transpose(1, 2)}[layout]  # B=2 batches of S=3
    assert torch.equal(lse_tokens_heads(given, t, h), want)


def test_lse_of_rows_without_keys_becomes_minus_inf_there_only() -> None:
    inf = math.inf
    lse = torch.tensor([[inf, inf], [1.0, inf], [inf, 2.0]])
    empty = torch.tensor([True, False, False])  # token 0 sees no key
    got = lse_empty_rows(lse, empty)
    # token 1's +inf is an overflow where keys exist: it must reach the judge as it is
    assert torch.equal(got, torch.tensor([[-inf, -inf], [1.0, inf], [inf, 2.0]]))
    assert torch.equal(lse_empty_rows(lse, torch.zeros(3, 2, dtype=torch.bool)), lse)


def test_a_finite_minus_inf_is_read_at_or_below_its_ceiling_on_rows_without_keys() -> None:
    """FlashInfer's no-key LSE is -5e4 + log2(d) (base 2): -49999 / -49998 measured."""
    lse = torch.tensor([[-49999.0, -49998.0], [-49999.0, 3.0], [7.0, -49999.0]])
    empty = torch.tensor([True, False, True])
    got = lse_empty_rows(lse, empty, at_most=-5e4 + 64)
    inf = math.inf
    # row 1 sees keys: its value stays; row 2's 7.0 is not the library's -inf: it stays too
    assert torch.equal(got, torch.tensor([[-inf, -inf], [-49999.0, 3.0], [7.0, -inf]]))


def test_heads_first_is_transposed_even_when_square() -> None:
    n = 4
    heads_by_tokens = torch.arange(n * n, dtype=torch.float32).reshape(n, n)
    # by shape alone a square [H, T] reads as [T, H]; a library that says [H, T] is transposed
    assert torch.equal(lse_tokens_heads(heads_by_tokens, n, n), heads_by_tokens)
    assert torch.equal(lse_tokens_heads(heads_by_tokens, n, n, heads_first=True),
                       heads_by_tokens.T)
    with pytest.raises(ValueError, match=r"not \[4 heads, 5 tokens\]"):
        lse_tokens_heads(torch.zeros(5, 4), 5, 4, heads_first=True)


def test_signature_problems_names_absent_renamed_and_new_required() -> None:
    lib = types.SimpleNamespace(
        fits=lambda a, b=1: None, renamed=lambda a, c=1: None, needs_more=lambda a, d: None)

    def lookup(name: str) -> object:
        return getattr(lib, name)

    called = {"fits": ("a", "b"), "renamed": ("a", "b"), "needs_more": ("a",), "gone": ("a",)}
    problems = signature_problems(lookup, "lib", called)
    assert set(problems) == {"renamed", "needs_more", "gone"}
    assert problems["renamed"] == "lib.renamed has no parameter 'b' (renamed or removed)"
    assert "requires parameter 'd'" in problems["needs_more"]
    assert problems["gone"] == "lib has no gone"


def test_library_version_names_the_imported_release_when_metadata_disagrees(monkeypatch) -> None:
    """Two installs in one directory (0.2.14's metadata, 0.7.2's files) once labelled a run of
    FlashInfer 0.7.2 as 0.2.14: the module's own __version__ is what ran."""
    import importlib.metadata
    import types

    from mlacheck.backends import toolkit

    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.2.14.post1")
    mod = types.ModuleType("fake_lib")
    mod.__version__ = "0.7.2.post1"
    assert toolkit.library_version(["fake-lib"], mod) == (
        "fake-lib 0.7.2.post1 (its installed metadata says 0.2.14.post1)")
    mod.__version__ = "0.2.14-post1"  # the same release spelled otherwise
    assert toolkit.library_version(["fake-lib"], mod) == "fake-lib 0.2.14.post1"
    assert toolkit.library_version(["fake-lib"]) == "fake-lib 0.2.14.post1"


def test_library_version_ignores_a_placeholder_module_version(monkeypatch) -> None:
    """FlashInfer built from source without its _build_meta says "0.0.0+unknown"; preferred
    over the metadata it made `release()` (0, 0) and a 0.7 install a 0.2-line kernel limit."""
    import importlib.metadata
    import types

    from mlacheck.backends import flashinfer, toolkit

    def version(dist: str) -> str:
        if dist != "fake-lib":
            raise importlib.metadata.PackageNotFoundError(dist)
        return "0.7.2.post1"

    monkeypatch.setattr(importlib.metadata, "version", version)
    mod = types.ModuleType("fake_lib")
    for placeholder in ("0.0.0+unknown", "0.0.0", "unknown"):
        mod.__version__ = placeholder
        label = toolkit.library_version(["fake-lib"], mod)
        assert label == "fake-lib 0.7.2.post1"
        assert flashinfer.release(label) == (0, 7)
    mod.__version__ = "0.0.0+unknown"
    assert toolkit.library_version(["not-installed"], mod) == "unknown version"


def test_checkout_commit_says_dirty_when_tracked_files_differ(tmp_path) -> None:
    """A tree copied or edited after its commit is recorded as '<commit>+dirty', not as the
    commit (the GPU machine's copy of a newer tree was recorded as the session's first commit)."""
    import subprocess

    from mlacheck import preflight

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    clean = preflight._checkout_commit(tmp_path)
    assert clean and "+" not in clean
    (tmp_path / "untracked.txt").write_text("not part of the code\n")
    assert preflight._checkout_commit(tmp_path) == clean
    (tmp_path / "a.py").write_text("x = 2\n")
    assert preflight._checkout_commit(tmp_path) == clean + "+dirty"
