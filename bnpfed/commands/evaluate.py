"""``bnpfed evaluate``: a saved global network (:func:`bnpfed.saved.save_global`, ``bnpfed match``, ``--save-global``)
on a dataset's test split: accuracy, NLL, ECE (``--ece-bins`` and 15 bins), the debiased L2 calibration error
(:func:`~bnpfed.metrics.debiased_calibration_error`), Brier score, each with a 95 % bootstrap interval over the test
examples (:func:`~bnpfed.metrics.bootstrap_intervals`, resampled as an experiment of seed 0 resamples), and with
``--ood`` the AUROC of telling in- from out-of-distribution inputs. A Bayesian global network is scored by its
posterior predictive (the softmax averaged over ``--predictive-samples`` weight draws, seeded by ``--seed``).

The test inputs are prepared as the model's training inputs were: standardised with the constants the file records,
or kept as read (pixels in [0, 1]) for a model trained on raw pixels (``bnpfed pfnm``'s default). A
``--standardize`` / ``--no-standardize`` that contradicts the file is refused; a file that records nothing (bnpfed
0.2's, ``bnpfed match`` on networks saved without it) is scored on standardised inputs unless told, with a note.

Examples::

    bnpfed evaluate global.pt --dataset mnist --data-dir DIR                     # inputs prepared as in training
    bnpfed evaluate global.pt --dataset mnist --data-dir DIR --ood fashion-mnist --ood-data-dir DIR2 --json e.json
    bnpfed evaluate fused/match-conflation.pt --dataset mnist --data-dir DIR --predictive-samples 50 --seed 1
"""

from __future__ import annotations

import torch

import dataclasses
import sys

from bnpfed.commands import _args
from bnpfed.commands._args import HelpFormatter, UsageError, fail, flag_message
from bnpfed.metrics import (INTERVAL_METRICS, bootstrap_intervals, classification_report, count_parameters,
                            debiased_calibration_error, expected_calibration_error, ood_auroc)
from bnpfed.report import command_record, command_results, format_table, with_intervals, write_json
from bnpfed.seeding import Stream, derive_seed

PROG = "bnpfed evaluate"
#: Weight draws of a Bayesian network's posterior predictive when --predictive-samples is not given (bnpfed fuse's).
PREDICTIVE_SAMPLES = 10


def add_parser(sub):
    p = sub.add_parser(
        "evaluate", help="a saved global network on a dataset's test split (accuracy, NLL, ECE, Brier, OOD AUROC)",
        description=_args.paragraphs(
            "Load a global network file (bnpfed match, save_global) and report its accuracy, negative "
            "log-likelihood, expected calibration error and Brier score on the test split of --dataset; with --ood "
            "also the AUROC of telling in- from out-of-distribution inputs by the maximum probability and by the "
            "entropy. The inputs are prepared as the clients saw them in training, as the file records. The "
            "file holds a pickle: evaluate only files you trust."),
        epilog=_args.examples(__doc__), formatter_class=HelpFormatter)
    p.add_argument("model", metavar="MODEL", help="the global network file")
    _args.add_data_arguments(p, standardize=None, standardize_help="standardise inputs, or keep pixels in [0, 1] "
                             "(--no-standardize). Default: as the file records its model's training inputs "
                             "(standardised with its constants, or not); standardised for a file that records none")
    p.add_argument("--ood", type=_args.dataset_name, metavar="NAME",
                   help="another dataset whose test images are out-of-distribution inputs (adds the AUROCs)")
    p.add_argument("--ood-data-dir", metavar="DIR", help="the folder of the --ood dataset (default: --data-dir)")
    p.add_argument("--ece-bins", type=int, default=15, metavar="BINS", help="bins of the calibration error")
    p.add_argument("--predictive-samples", "--samples", dest="predictive_samples", type=int, metavar="S",
                   help=f"a Bayesian network only: weight draws S of the posterior predictive (default: the file's, "
                   f"those its method scored it with, else {PREDICTIVE_SAMPLES})")
    p.add_argument("--seed", type=int, help="a Bayesian network only: seed of the weight draws, >= 0 (default: the "
                   "file's, else 0)")
    p.add_argument("--json", metavar="PATH", help="also write the metrics as JSON")
    p.set_defaults(func=run)


def prepare(args) -> dict:
    _args.check_output_path(args.json, "--json")
    if args.ece_bins < 1:
        raise UsageError(f"--ece-bins: expected an integer >= 1, got {args.ece_bins}")
    _args.check_ood_flags(args)
    from bnpfed.saved import read_global

    try:
        saved = read_global(args.model)
    except ValueError as error:
        raise UsageError(f"MODEL: {str(error).split(': ', 1)[-1]}") from None
    given = [flag for flag, value in (("--predictive-samples", args.predictive_samples), ("--seed", args.seed))
             if value is not None]
    if saved.client is None and given:
        raise UsageError(f"{given[0]}: expected only with a Bayesian global network, got a deterministic one "
                         f"({saved.method}) in {args.model!r}")
    if saved.client is not None:   # default: the draws the file says its method scored it with, else S=10, seed 0
        recorded = saved.predictive or {"samples": PREDICTIVE_SAMPLES, "seed": 0}
        args.predictive_samples = recorded["samples"] if args.predictive_samples is None else args.predictive_samples
        args.seed = recorded["seed"] if args.seed is None else args.seed
        if args.predictive_samples < 1:
            raise UsageError(f"--predictive-samples: expected an integer >= 1, got {args.predictive_samples}")
        if args.seed < 0:
            raise UsageError(f"--seed: expected an integer >= 0, got {args.seed}")
    dataset, ood, notes = prepared_data(args, saved)
    if dataset.task == "regression":
        raise UsageError(f"--dataset {dataset.name}: a regression; bnpfed evaluate scores a classifier's class "
                         "probabilities")
    net = saved.network
    try:
        with torch.no_grad():
            out = net(dataset.x_test[:1])
    except Exception as error:
        raise UsageError(f"--dataset: the network cannot run on its inputs of shape {tuple(dataset.input_shape)} "
                         f"({type(error).__name__}: {_args.one_line(error, 200)})") from None
    if out.dim() != 2 or out.shape[1] != dataset.num_classes:
        raise UsageError(f"--dataset: expected a network with {dataset.num_classes} outputs (its classes), got "
                         f"output shape {tuple(out.shape[1:])}")
    return dict(saved=saved, dataset=dataset, ood=ood, notes=notes)


def prepared_data(args, saved) -> tuple:
    """``--dataset`` (and ``--ood``'s inputs) prepared as the file records its model's training inputs, and the
    notes to say: ``(dataset, ood or None, notes)``. A flag that contradicts the record, or data the model cannot
    take (another input shape or class count), is a :class:`UsageError`."""
    inputs = saved.inputs
    if inputs is None:   # a file of bnpfed 0.2, or of bnpfed match on networks that did not record theirs
        standardize = True if args.standardize is None else args.standardize
        notes = [] if args.standardize is not None else [
            f"{args.model} does not record how its model's inputs were prepared; scoring it on standardised "
            "inputs: pass --no-standardize if it was trained on pixels in [0, 1] (bnpfed pfnm's default)"]
        return (*_args.load_data_and_ood(args, standardize=standardize), notes)
    if args.standardize is not None and args.standardize != inputs.standardized:
        flag = "--standardize" if args.standardize else "--no-standardize"
        raise UsageError(f"{flag}: expected it left out or as the file records: the model in {args.model!r} was "
                         f"trained on {inputs.dataset} inputs {inputs.describe()}, and is scored on inputs prepared "
                         "the same way by default")
    dataset, ood = _args.load_data_and_ood(args, standardize=False)
    problems = inputs.mismatches(dataset, prepared=False)
    if problems:
        raise UsageError(f"--dataset: expected data the model in {args.model!r} takes, got {dataset.name}: "
                         f"{'; '.join(problems)}")
    notes = [f"{d}; its inputs are prepared as the model's were ({inputs.describe()})"
             for d in inputs.differences(dataset)]
    dataset = dataclasses.replace(dataset, x_train=inputs.apply(dataset.x_train), x_test=inputs.apply(dataset.x_test),
                                  mean=inputs.mean, std=inputs.std)
    return dataset, None if ood is None else inputs.apply(ood), notes


def _probs(saved, x, args, chunk: int = 2048) -> torch.Tensor:
    """Class probabilities of ``x``: the network's softmax, or a Bayesian network's posterior predictive (each chunk
    drawn from ``--seed``, as bnpfed fuse scores it)."""
    if saved.client is not None:
        def predict(xb):
            return saved.client.predict_proba(xb, num_samples=args.predictive_samples, seed=args.seed)
    else:
        def predict(xb):
            return saved.network(xb).softmax(-1)
    with torch.no_grad():
        return torch.cat([predict(x[i:i + chunk]) for i in range(0, len(x), chunk)]).double()


def run(args) -> int:
    try:
        plan = prepare(args)
    except UsageError as error:
        return fail(PROG, str(error))
    except ValueError as error:
        return fail(PROG, flag_message(error))
    saved, dataset = plan["saved"], plan["dataset"]
    for note in plan["notes"]:
        print(f"{PROG}: note: {_args.one_line(note, 600)}", file=sys.stderr)
    probs = _probs(saved, dataset.x_test, args)
    row = {"method": saved.method, **classification_report(probs, dataset.y_test, n_bins=args.ece_bins)}
    row["ece15"] = expected_calibration_error(probs, dataset.y_test, n_bins=15)
    if len(probs) >= 2:
        row["ece_debiased"] = debiased_calibration_error(probs, dataset.y_test)
    metrics = INTERVAL_METRICS if len(probs) >= 2 else tuple(m for m in INTERVAL_METRICS if m != "ece_debiased")
    row["intervals"] = {m: list(v) for m, v in bootstrap_intervals(
        probs, dataset.y_test, metrics=metrics, ece_bins=args.ece_bins,
        seed=derive_seed(0, Stream.BOOTSTRAP)).items()}
    if plan["ood"] is not None:
        row.update(ood_auroc(probs, _probs(saved, plan["ood"], args)))
    row["parameters"] = count_parameters(saved.network)
    how = ("" if saved.client is None else f", Bayesian: posterior predictive of {args.predictive_samples} weight "
           f"draws, seed {args.seed}")
    prepared = ("inputs as the file records: " + saved.inputs.describe() if saved.inputs is not None else
                "inputs " + dataset.preprocessing().describe() + ", which the file does not record")
    print(f"{args.model}: {saved.method} global network ({saved.architecture}{how}) on {dataset.name}'s test split "
          f"({len(dataset.y_test)} examples; {prepared})")
    print(format_table(with_intervals([row], ("accuracy", "nll", "ece15")),
                       [k for k in row if k != "intervals"] + ["accuracy_95", "nll_95", "ece15_95"]))
    print("*_95: 95 % bootstrap intervals over the test examples (--json: every metric's); ece_debiased: Kumar et "
          "al.'s debiased L2 calibration error, 15 equal-mass bins")
    if args.json:
        write_json(args.json, command_record("evaluate", args, {"model": args.model, "kind": saved.kind,
                                                               "widths": saved.widths,
                                                               "inputs": dataset.preprocessing().as_dict(),
                                                               "notes": plan["notes"]},
                                             command_results([{"rows": [row]}])))
        print(f"wrote results to {args.json}")
    return 0
