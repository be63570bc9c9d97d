"""``bnpfed mixture``: the federated Gaussian mixture on a real data set
(:func:`bnpfed.federated.run_mixture_experiment`): each client fits a Pyro mixture to its own data, the server
matches and fuses the components (the Beta-Bernoulli process decides how many), and the held-out log-likelihood is
compared with each client's own mixture, the union of the clients' mixtures and a mixture fitted to the pooled data.

Examples::

    bnpfed mixture                                        # the bundled digits, J = 5 clients, K = 10, 10 dimensions
    bnpfed mixture --clients 10 --alpha 0.1 --json mixture.json
    bnpfed mixture --dataset mnist --dims 20 --components 20
"""

from __future__ import annotations

from dataclasses import asdict

from bnpfed.commands._args import HelpFormatter, UsageError, check_output_path, examples, fail, flag_message, \
    paragraphs
from bnpfed.federated import MixtureConfig, run_mixture_experiment
from bnpfed.report import command_record, command_results, format_table, write_json

PROG = "bnpfed mixture"


def add_parser(sub):
    d = MixtureConfig()
    p = sub.add_parser(
        "mixture", help="a federated Gaussian mixture: clients' components matched and fused, on held-out data",
        description=paragraphs(
            "Project a data set on its first principal components, split it among J clients by label (Dirichlet), "
            "fit a Gaussian mixture (Pyro, MAP) on every client, match the clients' components under the "
            "Beta-Bernoulli process and fuse each global component's members (bnpfed.federated.fuse_mixtures), and "
            "print the held-out log-likelihood per test point of the federated mixture, each client's own, the "
            "union of the clients' and a mixture fitted to the pooled data."),
        epilog=examples(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--dataset", default=d.dataset, help="digits (bundled), mnist or fashion-mnist (from --data-dir)")
    p.add_argument("--data-dir", default=d.data_dir, metavar="PATH", help="where the torchvision data sets are")
    p.add_argument("--clients", type=int, default=d.clients, help="number of clients J, >= 2")
    p.add_argument("--components", type=int, default=d.components, help="components K of every local mixture, >= 1")
    p.add_argument("--dims", type=int, default=d.dims, help="principal components the data are projected on, >= 1")
    p.add_argument("--alpha", type=float, default=d.alpha,
                   help="Dirichlet concentration of the label split (small: each client sees few classes), > 0")
    p.add_argument("--steps", type=int, default=d.steps, help="Adam steps of every mixture's fit, >= 1")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the split, the fits and the matching, >= 0")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        check_output_path(args.json, "--json")
        config = MixtureConfig(dataset=args.dataset, data_dir=args.data_dir, clients=args.clients,
                               components=args.components, dims=args.dims, alpha=args.alpha, steps=args.steps,
                               seed=args.seed)
        rows = [asdict(r) for r in run_mixture_experiment(config)]
    except UsageError as error:
        return fail(PROG, str(error))
    except ValueError as error:
        return fail(PROG, flag_message(error))
    print(f"federated Gaussian mixture: {config.dataset} on {config.dims} principal components, J = {config.clients} "
          f"clients (label Dirichlet alpha = {config.alpha}), K = {config.components} per client, seed {config.seed}")
    print(format_table(rows))
    print("heldout_loglik: mean log-likelihood of a test point (nats; higher is better)")
    if args.json:
        write_json(args.json, command_record("mixture", args, asdict(config), command_results([{"rows": rows}])))
        print(f"wrote results to {args.json}")
    return 0
