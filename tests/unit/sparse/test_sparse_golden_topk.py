"""The tie-aware top-k check: correct selections (ties, near-ties within the bound, short
rows) pass; each way of being wrong fails and says why."""

from __future__ import annotations

import torch

from mlacheck.golden.topk import check_selection, reference_topk

NEG = float("-inf")


def test_reference_topk_orders_largest_first_ties_to_lower_position() -> None:
    lg = torch.tensor([[1.0, 3.0, 3.0, NEG, 2.0], [NEG, NEG, 0.5, NEG, NEG]])
    assert reference_topk(lg, 3).tolist() == [[1, 2, 4], [2, -1, -1]]


def test_exact_ties_may_go_either_way() -> None:
    lg = torch.tensor([[5.0, 1.0, 1.0, 1.0, 0.0]])
    for sel in ([0, 1], [0, 2], [3, 0]):
        r = check_selection(torch.tensor([sel]), lg, 0.0, 2)
        assert r.all_ok, r.problems
    assert check_selection(torch.tensor([[0, 4]]), lg, 0.0, 2).all_ok is False


def test_near_ties_within_the_bound_pass_and_beyond_it_fail() -> None:
    lg = torch.tensor([[10.0, 5.0, 4.99, 1.0]])
    assert check_selection(torch.tensor([[0, 2]]), lg, 0.01, 2).all_ok
    r = check_selection(torch.tensor([[0, 2]]), lg, 0.001, 2)
    assert not r.all_ok and float(r.margin[0]) < 0 and "error bounds" in r.problems[0]
    assert float(r.recall[0]) == 0.5


def test_a_per_position_bound_is_used_per_position() -> None:
    lg = torch.tensor([[10.0, 5.0, 4.0, 1.0]])
    bound = torch.tensor([[0.0, 0.6, 0.6, 0.0]])  # 5 - 0.6 < 4 + 0.6: a tie within bounds
    assert check_selection(torch.tensor([[0, 2]]), lg, bound, 2).all_ok
    bound = torch.tensor([[0.0, 0.4, 0.4, 0.0]])
    assert not check_selection(torch.tensor([[0, 2]]), lg, bound, 2).all_ok


def test_perturbed_logits_within_the_bound_always_pass() -> None:
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(50, 300, generator=g).round(decimals=2)  # many exact and near ties
    lg[:, 250:] = NEG
    lg[7, 10:] = NEG  # a row shorter than k
    bound = torch.rand(50, 300, generator=g) * 0.05
    for _ in range(5):
        noisy = lg + (torch.rand(50, 300, generator=g) * 2 - 1) * bound
        sel = torch.topk(noisy, 64, dim=1).indices
        sel = torch.where(torch.isinf(noisy.gather(1, sel)), torch.full_like(sel, -1), sel)
        r = check_selection(sel[:, torch.randperm(64, generator=g)], lg, bound, 64)
        assert r.all_ok, r.problems
        assert float(r.recall.min()) > 0.5 and bool((r.margin >= 0).all())


def test_each_way_of_being_wrong_is_named() -> None:
    lg = torch.tensor([[4.0, 3.0, 2.0, 1.0, NEG, NEG]])
    cases = {
        "masked": [0, 1, 2, 4],  # a masked position chosen
        "out-of-range": [0, 1, 2, 9],
        "duplicate": [0, 1, 1, 2],
        "below -1": [0, 1, 2, -2],
        "expected": [0, 1, 2, -1],  # one valid position missing (counted -1 as a position)
    }
    for word, sel in cases.items():
        r = check_selection(torch.tensor([sel]), lg, 0.0, 4)
        assert not r.all_ok, word
        assert word.split("-")[0] in r.problems[0], (word, r.problems)
    ok = check_selection(torch.tensor([[3, 2, 1, 0]]), lg, 0.0, 4)
    assert ok.all_ok and float(ok.margin[0]) == float("inf")


def test_a_row_shorter_than_k_must_choose_all_its_positions_and_pad() -> None:
    lg = torch.tensor([[1.0, NEG, 2.0, NEG]])
    assert check_selection(torch.tensor([[2, 0, -1]]), lg, 0.0, 3).all_ok
    assert not check_selection(torch.tensor([[2, -1, -1]]), lg, 0.0, 3).all_ok
    assert check_selection(torch.tensor([[-1, -1]]), torch.full((1, 4), NEG), 0.0, 2).all_ok


def test_extra_columns_must_be_padding() -> None:
    lg = torch.tensor([[4.0, 3.0, 2.0]])
    assert check_selection(torch.tensor([[0, 1, -1, -1]]), lg, 0.0, 2).all_ok
    assert not check_selection(torch.tensor([[0, 1, 2, -1]]), lg, 0.0, 2).all_ok


def test_blocking_gives_the_same_report() -> None:
    g = torch.Generator().manual_seed(1)
    lg = torch.randn(40, 100, generator=g)
    sel = torch.topk(lg + 0.3 * torch.randn(40, 100, generator=g), 10).indices
    a = check_selection(sel, lg, 0.005, 10)
    b = check_selection(sel, lg, 0.005, 10, budget=150)
    assert torch.equal(a.ok, b.ok) and torch.equal(a.margin, b.margin)
    assert not a.all_ok  # noise far beyond the bound: some rows go wrong
