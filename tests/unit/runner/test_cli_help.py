"""What `mlacheck --help` and `mlacheck list` tell a new user (issue 16): every option says
what it does, matrix names are listed, capabilities read as values, not Python reprs."""

from __future__ import annotations

import re

import pytest

from mlacheck import cli, inventory
from mlacheck.backends.base import Capability, Range
from mlacheck.matrices import names


def _help(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_run_help_documents_every_option_and_names_the_matrices(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = _help("run", capsys=capsys)
    for name in names():
        assert name in text, name
    for option, words in (("--matrix", "matrix name"), ("--device", "cuda:N"),
                          ("--golden", "precision of the reference"),
                          ("--results", "results file"), ("--seed", "offset added"),
                          ("--no-report", "no report.md")):
        assert re.search(re.escape(option) + r"\b[^-]*?" + re.escape(words), text) or (
            option in text and words in text), (option, text)
    assert text.count("--") >= 18


def test_replay_and_selftest_options_say_what_they_do(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = _help("replay", capsys=capsys)
    assert "Re-run one case" in text and "comma-separated" in text
    assert "precision of the reference" in text and "cuda:N" in text
    from mlacheck import selftest

    device = next(a for a in selftest.build_parser()._actions if "--device" in a.option_strings)
    assert device.help and "cuda" in device.help


def _long_prefill_only(case: object) -> str | None:
    return None


def _heads_fold_rule(gfx: str):  # noqa: ANN202 - a rule factory, as backends write them
    def rule(case: object) -> str | None:
        return None

    return rule


def test_capability_values_read_as_values() -> None:
    assert inventory.describe_value(_heads_fold_rule("gfx942")) == "heads fold rule"  # its factory
    assert inventory.describe_value("aiter-model mla_prefill: no paged layouts") == (
        "aiter-model mla_prefill: no paged layouts")  # a string, not a set of its characters
    assert inventory.describe_value((1024, 16, 64, 1)) == "{1, 16, 64, 1024}"  # numeric order
    assert inventory.describe_value(_long_prefill_only) == "long prefill only"  # a rule by its name
    assert inventory.describe_value((("bf16", "fp8_e4m3fn"),)) == "{bf16/fp8_e4m3fn}"
    cap = Capability(page_sizes=(64, 1, 16), refusal="needs a GPU", rules=(_long_prefill_only,),
                     head_counts=Range(16, 128))
    line = inventory.describe_capability(cap)
    assert "page_sizes={1, 16, 64}" in line and "refusal=needs a GPU" in line
    assert "<function" not in line and "{ ," not in line


def test_list_prints_no_reprs_and_folds_the_faults(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "<function" not in out and "object at 0x" not in out
    assert not re.search(r"\{([^\d\s]), ([^\d\s]), ", out), "a string as a set of characters"
    assert not any(line.lstrip().startswith("fault:") for line in out.splitlines()[:-1]
                   if "planted faults" not in line)
    for sizes in re.findall(r"page_sizes=\{([0-9, ]+)\}", out):
        nums = [int(x) for x in sizes.split(", ")]
        assert nums == sorted(nums), sizes
