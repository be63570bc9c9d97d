"""``bnpfed evaluate``: a saved global network (:func:`bnpfed.saved.save_global`, ``bnpfed match``) on a dataset's
test split: accuracy, NLL, ECE (``--ece-bins`` and 15 bins), Brier score, and with ``--ood`` the AUROC of telling
in- from out-of-distribution inputs.

Examples::

    bnpfed evaluate global.pt --dataset mnist --data-dir DIR --no-standardize    # as PFNM's clients saw the pixels
    bnpfed evaluate global.pt --dataset mnist --data-dir DIR --ood fashion-mnist --ood-data-dir DIR2 --json e.json
"""

from __future__ import annotations

import torch

from bnpfed.commands import _args
from bnpfed.commands._args import HelpFormatter, UsageError, fail, flag_message
from bnpfed.metrics import classification_report, count_parameters, expected_calibration_error, ood_auroc
from bnpfed.report import command_record, command_results, format_table, write_json

PROG = "bnpfed evaluate"


def add_parser(sub):
    p = sub.add_parser(
        "evaluate", help="a saved global network on a dataset's test split (accuracy, NLL, ECE, Brier, OOD AUROC)",
        description=_args.paragraphs(
            "Load a global network file (bnpfed match, save_global) and report its accuracy, negative "
            "log-likelihood, expected calibration error and Brier score on the test split of --dataset; with --ood "
            "also the AUROC of telling in- from out-of-distribution inputs by the maximum probability and by the "
            "entropy. The inputs must be prepared as the clients saw them in training (--standardize or not). The "
            "file holds a pickle: evaluate only files you trust."),
        epilog=_args.examples(__doc__), formatter_class=HelpFormatter)
    p.add_argument("model", metavar="MODEL", help="the global network file")
    _args.add_data_arguments(p, standardize=True, standardize_help="standardise inputs with the train split's "
                             "constants (bnpfed fuse's default), or keep pixels in [0, 1] (--no-standardize: PFNM's)")
    p.add_argument("--ood", type=_args.dataset_name, metavar="NAME",
                   help="another dataset whose test images are out-of-distribution inputs (adds the AUROCs)")
    p.add_argument("--ood-data-dir", metavar="DIR", help="the folder of the --ood dataset (default: --data-dir)")
    p.add_argument("--ece-bins", type=int, default=15, metavar="BINS", help="bins of the calibration error")
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
    dataset, ood = _args.load_data_and_ood(args, standardize=args.standardize)
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
    return dict(saved=saved, dataset=dataset, ood=ood)


def _probs(net, x, chunk: int = 2048) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([net(x[i:i + chunk]).softmax(-1) for i in range(0, len(x), chunk)]).double()


def run(args) -> int:
    try:
        plan = prepare(args)
    except UsageError as error:
        return fail(PROG, str(error))
    except ValueError as error:
        return fail(PROG, flag_message(error))
    saved, dataset = plan["saved"], plan["dataset"]
    probs = _probs(saved.network, dataset.x_test)
    row = {"method": saved.method, **classification_report(probs, dataset.y_test, n_bins=args.ece_bins)}
    row["ece15"] = expected_calibration_error(probs, dataset.y_test, n_bins=15)
    if plan["ood"] is not None:
        row.update(ood_auroc(probs, _probs(saved.network, plan["ood"])))
    row["parameters"] = count_parameters(saved.network)
    print(f"{args.model}: {saved.method} global network ({saved.architecture}) on {dataset.name}'s test split "
          f"({len(dataset.y_test)} examples)")
    print(format_table([row]))
    if args.json:
        write_json(args.json, command_record("evaluate", args, {"model": args.model, "widths": saved.widths},
                                             command_results([{"rows": [row]}])))
        print(f"wrote results to {args.json}")
    return 0
