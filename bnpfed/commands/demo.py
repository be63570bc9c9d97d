"""``bnpfed demo``: sample a federated layer from the Beta-Bernoulli model, match it, print how well the matching
recovered it (:func:`bnpfed.matching.match_recovery`).

Examples::

    bnpfed demo                                    # J = 10 clients, D = 50
    bnpfed demo --clients 20 --sigma2 0.05 --json demo.json
"""

from __future__ import annotations

from dataclasses import asdict

from bnpfed.commands._args import HelpFormatter, UsageError, check_output_path, fail, flag_message, paragraphs
import bnpfed.matching as matching   # called through the face at run time (tests stand in for match_recovery)
from bnpfed.report import command_record, command_results, format_table, write_json

PROG = "bnpfed demo"


def add_parser(sub):
    d = matching.RecoveryConfig()
    p = sub.add_parser(
        "demo",
        help="sample a federated layer from the Beta-Bernoulli model, match it, print recovery",
        description=paragraphs(
            "Sample J clients' neurons from the Beta-Bernoulli (IBP) model of PFNM, match them with the Hungarian "
            "MAP matcher (at the true noise variance and at twice it) and with the marginal objective, and print the "
            "true against the found number of global neurons, the adjusted Rand index of the assignments (1: the "
            "true grouping), the objective and the matching's seconds."),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--clients", type=int, default=d.clients, help="number of clients J, >= 1")
    p.add_argument("--dim", type=int, default=d.dim, help="neuron dimension D, >= 1")
    p.add_argument("--gamma0", type=float, default=d.gamma0, help="IBP mass (sampling and matching), > 0")
    p.add_argument("--sigma2", "--noise", dest="sigma2", type=float, default=d.sigma2,
                   help="true local noise variance of the sampled neurons, > 0")
    p.add_argument("--sigma0-2", type=float, default=d.sigma0_2, help="prior variance of the global atoms, > 0")
    p.add_argument("--sweeps", type=int, default=d.sweeps, help="matching sweeps after the greedy pass, >= 0")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the sample and the matching, >= 0")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar of the matchings' passes (the clients re-matched) on stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        check_output_path(args.json, "--json")
        config = matching.RecoveryConfig(clients=args.clients, dim=args.dim, gamma0=args.gamma0, sigma2=args.sigma2,
                                         sigma0_2=args.sigma0_2, sweeps=args.sweeps, seed=args.seed)
    except UsageError as error:
        return fail(PROG, str(error))
    except ValueError as error:
        return fail(PROG, flag_message(error))
    rows = [asdict(r) for r in matching.match_recovery(config, progress=not args.no_progress)]
    print(f"Beta-Bernoulli layer: J = {config.clients} clients, D = {config.dim}, gamma0 = {config.gamma0}, "
          f"noise variance sigma2 = {config.sigma2}, sigma0_2 = {config.sigma0_2}, seed {config.seed}")
    print(format_table(rows))
    print("adjusted_rand: 1 when the matching groups the neurons as the sample did; seconds: the wall time of the "
          "matching alone (sampling not included)")
    if args.json:
        write_json(args.json, command_record("demo", args, asdict(config), command_results([{"rows": rows}])))
        print(f"wrote results to {args.json}")
    return 0
