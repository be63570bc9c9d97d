"""What pooled heads cost at prediction time (made here, no data needed): J = 10 clients of a 784-100-10 MLP and of
LeNet (28 x 28 inputs), matched with a noise far below their units' distances so that nothing merges (the widest
global network, J x 100 units: the worst case for the heads), predicting N inputs:

* the global network (PFNM's fused output layer) against the same body with the J clients' heads pooled
  (:func:`bnpfed.matching.pooled_network`);
* the pool-temperature step of one client (:func:`bnpfed.federated.clients.pool_nll_step`, 61 temperatures, its
  share N / J of the inputs);
* matched posterior fusion's predictive (S = 10 draws, the fused global Bayesian network) against
  :class:`bnpfed.matching.PooledPosterior` 's (S draws of the body and the J heads, pooled inside each draw).

Rows in one process, best of ``repeats``; the ratio is against the fused row of the same network. The extra memory
of the heads is their parameters, ``(J - 1) C (L + 1)`` more floats than one output layer, and one forward pass's
``J N C`` logits.

Usage: python benchmarks/bench_pooled.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch

from bnpfed.federated.clients import bayesian_client, initial_network, pool_nll_step
from bnpfed.federated.config import BayesianConfig, NetworkConfig
from bnpfed.federated.matched_fusion import bayesian_from_match
from bnpfed.matching import PooledPosterior, match_by_spec, pooled_network
from bnpfed.matching.posteriors import client_posterior, match_posteriors
from bnpfed.metrics import count_parameters
from bnpfed.report import format_table

J, C, SHAPE = 10, 10, (1, 28, 28)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(quick: bool = False, repeats: int = 3) -> list[dict]:
    n = 2_000 if quick else 10_000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *SHAPE, generator=g)
    counts = torch.randint(1, 100, (J, C), generator=g).double()
    rows = []
    for arch in ("mlp", "lenet"):
        network = NetworkConfig(arch=arch, hidden=(100,)) if arch == "mlp" else NetworkConfig(arch=arch)
        nets = [initial_network(network, SHAPE, C, seed=0, client=j).eval() for j in range(J)]
        match = match_by_spec(nets, counts, input_shape=SHAPE, sigma2=1e-8, sigma0_2=10.0, gamma0=1.0,
                              hyperparameters="fixed", seed=0)
        fused, pooled = match.network().eval(), pooled_network(match, nets)
        share = x[: n // J], torch.randint(0, C, (n // J,), generator=g)
        with torch.no_grad():
            t_fused = _best(lambda: fused(x), repeats)
            t_pooled = _best(lambda: pooled(x), repeats)
        t_nll = _best(lambda: pool_nll_step(pooled, *share), repeats)
        extra = count_parameters(pooled) - count_parameters(fused)
        rows += [{"network": arch, "predictor": "fused (PFNM)", "s": round(t_fused, 4), "x fused": 1.0,
                  "extra parameters": "-"},
                 {"network": arch, "predictor": "pooled heads", "s": round(t_pooled, 4),
                  "x fused": round(t_pooled / t_fused, 2), "extra parameters": f"{extra:,}"},
                 {"network": arch, "predictor": f"pool_nll_step, one client ({n // J} inputs)", "s": round(t_nll, 4),
                  "x fused": round(t_nll / t_fused, 2), "extra parameters": "-"}]
        bayesian = BayesianConfig()
        posteriors = [client_posterior(bayesian_client(net, bayesian)) for net in nets]
        template = initial_network(network, SHAPE, C, seed=0)
        pmatch = match_posteriors(posteriors, counts, rule="conflation", template=template, input_shape=SHAPE,
                                  tau2=1e-8, seed=0)
        global_client = bayesian_from_match(pmatch, bayesian)
        pooled_posterior = PooledPosterior.of_match(pmatch, posteriors)
        t_bayes = _best(lambda: global_client.predict_proba(x, num_samples=10, seed=0), repeats)
        t_pp = _best(lambda: pooled_posterior.predict_proba(x, num_samples=10, seed=0), repeats)
        rows += [{"network": arch, "predictor": "fused posterior, S = 10", "s": round(t_bayes, 4),
                  "x fused": round(t_bayes / t_fused, 2), "extra parameters": "-"},
                 {"network": arch, "predictor": "PooledPosterior, S = 10", "s": round(t_pp, 4),
                  "x fused": round(t_pp / t_fused, 2), "extra parameters": f"{extra:,} (means; variances as many)"}]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="2,000 inputs instead of 10,000")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"J = {J} clients, nothing merged (J x 100 global units for the MLP), 28 x 28 inputs; torch threads "
          f"{torch.get_num_threads()}")
    print(format_table(run(args.quick, args.repeats)))


if __name__ == "__main__":
    main()
