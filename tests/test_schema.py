"""One schema for every option (issue 50): each config field is declared once, with its help, and the docstrings'
``:param`` lines, the commands' flags and the Flower run-config keys come from that one declaration; the probes
measured worse than the defaults live in :mod:`bnpfed.experimental`, passed explicitly."""

from __future__ import annotations

import inspect
import typing
from dataclasses import fields
from typing import Optional, Union

import pytest

from bnpfed.cli import main
from bnpfed.experimental import ExperimentalOptions
from bnpfed.federated import (BayesianConfig, ExperimentConfig, FusionConfig, NetworkConfig, PartitionConfig,
                              PFNMConfig, TrainingConfig)
from bnpfed.schema import coerce, key_of, option_of, options, parse_assignments, render, summary

CONFIGS = [PartitionConfig, NetworkConfig, TrainingConfig, BayesianConfig, PFNMConfig, FusionConfig, ExperimentConfig,
           ExperimentalOptions]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_is_declared_once_with_its_help_and_its_docstring_line_comes_from_it(cls):
    declared = {f.name for f, _ in options(cls)}
    assert declared == {f.name for f in fields(cls)}
    doc = " ".join(inspect.getdoc(cls).split())
    for f, opt in options(cls):
        assert opt.help.strip() and "benchmarks/README" not in opt.help, f.name
        assert ":param" in doc and f" {f.name}: {' '.join(opt.help.split())}" in doc, f.name


def test_the_flower_keys_are_the_schema_fields_that_say_they_are_keys():
    pytest.importorskip("flwr")
    from bnpfed.flower.config import CONFIGS as FLOWER, EXPERIMENTAL, run_config_defaults

    expected = {key_of(f.name) for cls in FLOWER.values() for f, opt in options(cls) if opt.key is True}
    assert set(run_config_defaults()) == expected | {EXPERIMENTAL}
    assert "clients" not in expected and "experimental" not in {key_of(f.name) for cls in FLOWER.values()
                                                                for f, opt in options(cls) if opt.key is True}


@pytest.mark.parametrize("value, hint, expected", [
    ("4", int, 4), ("0.5", float, 0.5), ("true", bool, True), (False, bool, False),
    ("100,50", tuple[int, ...], (100, 50)), ([3, 4], tuple[int, ...], (3, 4)),
    ("0.3,auto", Union[None, float, tuple[Optional[float], ...]], (0.3, None)),
    ("none", Union[None, int, str], None), ("ensemble", Union[None, int, str], "ensemble"),
    ("5000", Union[None, int, str], 5000), ("fit", Union[float, str], "fit"), ("2", Union[float, str], 2.0),
    ("starts=both", ExperimentalOptions, ExperimentalOptions(starts="both")),
])
def test_a_command_line_or_run_config_value_becomes_the_fields_type(value, hint, expected):
    assert coerce(value, hint, "x", ("none", "auto")) == expected


@pytest.mark.parametrize("value, hint, message", [
    ("ten", int, "epochs: expected an int, got 'ten'"), ("fast", float, "epochs: expected a number, got 'fast'"),
    ("maybe", bool, "epochs: expected true or false, got 'maybe'"), ("", tuple[int, ...], "epochs: expected one"),
])
def test_a_value_that_does_not_read_names_its_field(value, hint, message):
    with pytest.raises(ValueError, match=message):
        coerce(value, hint, "epochs")


def test_the_default_help_shows_a_fields_first_sentence_written_for_the_command_line():
    assert summary('``"iid"`` or ``"dirichlet"``. The rest (e.g. ``1``) follows.') == '``"iid"`` or ``"dirichlet"``.'
    assert summary("a (first. Second) sentence, e.g. ``x``. Then more.") == "a (first. Second) sentence, e.g. ``x``."
    text = 'with ``partition="dirichlet"`` and ``alpha``; see :class:`~bnpfed.models.Prior` and ``"iid"``.'
    assert render(text, {"partition": "--partition", "alpha": "--alpha"}) == (
        "with --partition dirichlet and --alpha; see Prior and iid.")
    assert parse_assignments("", "experimental") == {}
    with pytest.raises(ValueError, match="experimental: expected each key once"):
        parse_assignments("stop=result,stop=fixed-point", "experimental")


def test_a_flag_reads_back_into_its_config_and_a_bad_value_is_refused_naming_the_flag(capsys):
    from bnpfed.cli import build_parser
    from bnpfed.commands import pfnm

    plan = pfnm.prepare(build_parser().parse_args(["pfnm", "--hidden", "20,10", "--max-width", "none,15", "--sigma2",
                                                    "0.3,auto", "--max-params", "none", "--no-warm-start"]))
    assert plan["network"].hidden == (20, 10) and plan["pfnm"].max_width == (None, 15)
    assert plan["pfnm"].sigma2 == (0.3, None) and plan["pfnm"].max_params is None and not plan["pfnm"].warm_start
    for argv, message in ((["--lr", "0"], "--lr: expected a positive finite number, got 0"),
                          (["--epochs", "2.5"], "--epochs: expected an int, got '2.5'"),
                          (["--partition", "clustered"], "--partition: expected one of ['iid', 'dirichlet']")):
        assert main(["pfnm", *argv]) == 2
        assert message in capsys.readouterr().err, argv


def test_a_config_reads_only_its_own_probes_and_the_old_keywords_warn_naming_the_new_form():
    probes = ExperimentalOptions(starts="both", inactive="keep")
    assert PFNMConfig(experimental=probes).inactive == "keep" and PFNMConfig.EXPERIMENTAL == (
        "starts", "stop", "schedule", "inactive")
    with pytest.raises(ValueError, match="experimental: FusionConfig reads starts, stop, later_rounds, pvi_damping; "
                                         "expected no other, got inactive='keep'"):
        FusionConfig(experimental=probes)
    with pytest.raises(ValueError, match="experimental: expected a bnpfed.experimental.ExperimentalOptions"):
        BayesianConfig(experimental="round-prior=posterior")
    with pytest.warns(DeprecationWarning, match=r"PFNMConfig\(experimental=ExperimentalOptions\(starts='both', "
                                                r"inactive='keep'\)\)"):
        assert PFNMConfig(starts="both", inactive="keep") == PFNMConfig(experimental=probes)
    assert "starts" not in {f.name for f in fields(PFNMConfig)}   # not a field: a flag or key of its own no more
    hints = typing.get_type_hints(PFNMConfig)
    assert hints["experimental"] is ExperimentalOptions and option_of(PFNMConfig, "experimental").cli is False
