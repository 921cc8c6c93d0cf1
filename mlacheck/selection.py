"""Which items of a run a `-k` / `-m` selection keeps, known before pytest collects them.

`mlacheck run` knows every item (case x backend) from the matrix, so an empty selection is
found in a second instead of after pytest and its workers started (issue 33: 6-74 s), and a
run interrupted before pytest wrote its run header can still record what it meant to run.
The expressions are evaluated by pytest's own evaluator (`_pytest.mark.expression`) on what
pytest matches them against: `-k` on the item's name, its parents' names and its markers'
names (a case-insensitive substring of any), `-m` on its markers. Which directories above
`mlacheck/suite` pytest names as parents depends on where its rootdir lies, so an item is
counted as kept or dropped only when the answer is the same with and without those names;
otherwise it is undecided and pytest decides.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The suite's test function and module: test_mla.py's item `test_mla[<item id>]`.
SUITE_MODULE = "test_mla.py"
TEST_FUNCTION = "test_mla"
# The marker every item carries besides the matrix's (the case's group for xdist --dist loadgroup).
GROUP_MARKER = "xdist_group"


def item_id(backend: str, case_id: str) -> str:
    """A matrix item's pytest id: the backend as requested, then the case id."""
    return f"{backend}-{case_id}"


@dataclass(frozen=True)
class Candidate:
    """One item as pytest will see it: the backend as requested, the case, its markers."""

    backend: str
    case_id: str
    markers: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return item_id(self.backend, self.case_id)


@dataclass
class Selection:
    kept: list[Candidate] = field(default_factory=list)  # selected whatever pytest's rootdir
    dropped: list[Candidate] = field(default_factory=list)  # deselected whatever the rootdir
    undecided: list[Candidate] = field(default_factory=list)

    @property
    def surely_empty(self) -> bool:
        return not self.kept and not self.undecided

    def backends_left_without_items(self, backends: Iterable[str]) -> list[str]:
        """Requested backends (as requested) none of whose items can be selected."""
        maybe = {c.backend for c in (*self.kept, *self.undecided)}
        return [b for b in backends if b not in maybe]


def parent_names(suite_file: Path | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(names pytest always gives the item's parents, names it may also give them): the
    module always; the packages and directories above it depending on the rootdir."""
    if suite_file is None:
        from mlacheck.suite import test_mla

        suite_file = Path(test_mla.__file__)
    always = (suite_file.name,)
    maybe = tuple(p.name for p in suite_file.resolve().parents if p.name)
    return always, maybe


def select(candidates: Sequence[Candidate], k: str | None, m: str | None,
           suite_file: Path | None = None) -> Selection:
    """Split the items by what `-k k -m m` does to them (expressions already checked). Where
    pytest's evaluator is not what this module knows (its private API moved), every item is
    undecided: pytest decides, after collection, as before."""
    try:
        keyword_matcher, mark_matcher, compile_ = _pytest_matchers()
    except (ImportError, AttributeError):
        return Selection(undecided=list(candidates))
    keyword = compile_(k) if k else None
    marker = compile_(m) if m else None
    always, maybe = parent_names(suite_file)
    out = Selection()
    for c in candidates:
        marks = (*c.markers, GROUP_MARKER)
        if marker is not None and not marker.evaluate(mark_matcher(c)):
            out.dropped.append(c)  # -m reads markers only: decided
            continue
        if keyword is None:
            out.kept.append(c)
            continue
        own = {f"{TEST_FUNCTION}[{c.id}]", *always, *marks}
        answers = {keyword.evaluate(keyword_matcher(names)) for names in (own, own | set(maybe))}
        if answers == {True}:
            out.kept.append(c)
        elif answers == {False}:
            out.dropped.append(c)
        else:
            out.undecided.append(c)
    return out


def _pytest_matchers():  # noqa: ANN202 - pytest's private matcher types
    """(names -> -k matcher, candidate -> -m matcher, expression compiler), as pytest >= 8
    builds them (MarkMatcher.from_markers since 8.3: `-m 'mark(key=value)'`)."""
    import pytest
    from _pytest.mark import KeywordMatcher, MarkMatcher
    from _pytest.mark.expression import Expression

    def marks(c: Candidate) -> list:  # noqa: ANN202
        return [*(getattr(pytest.mark, name).mark for name in c.markers),
                getattr(pytest.mark, GROUP_MARKER)(c.case_id).mark]

    if hasattr(MarkMatcher, "from_markers"):
        def mark_matcher(c: Candidate):  # noqa: ANN202
            return MarkMatcher.from_markers(marks(c))
    else:  # pytest 8.0-8.2: marker names only
        def mark_matcher(c: Candidate):  # noqa: ANN202
            return MarkMatcher(frozenset(mk.name for mk in marks(c)))
    return (lambda names: KeywordMatcher(frozenset(names))), mark_matcher, Expression.compile


def nothing_selected(matrix: str, cases: int, backends: int, left: int,
                     k: str | None, m: str | None) -> str:
    """Why a run selected no item: the matrix, --resume and -k / -m each take their part (the
    one wording of the plugin's exit-5 line and of `mlacheck run`'s check before pytest)."""
    total = cases * backends
    if not total:
        return f"matrix {matrix} has no cases"
    parts = [f"matrix {matrix}: {cases} case(s) x {backends} backend(s) = {total} item(s)"]
    if total > left:
        parts.append(f"{total - left} already have a verdict (--resume)")
    if left:
        how = [f"{flag} {expr!r}" for flag, expr in (("-k", k), ("-m", m)) if expr]
        parts.append(f"{'all ' if left == total else 'the other '}{left} deselected by "
                     + (" and ".join(how) or "the command line"))
    return "; ".join(parts)


def selected_by(k: str | None, m: str | None) -> str:
    """The selection options as the gate's lines name them ('' when none)."""
    return " and ".join(f"{flag} {expr!r}" for flag, expr in (("-k", k), ("-m", m)) if expr)
