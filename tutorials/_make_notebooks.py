"""Writes the tutorial notebooks from the cell sources below (run: python tutorials/_make_notebooks.py).

The notebooks are committed without outputs; the test suite executes them (tests/test_tutorials.py) with
BNPFED_TUTORIAL_QUICK=1, which shrinks the problem sizes.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent


def write(name, cells):
    nb = new_notebook(cells=[new_markdown_cell(c[3:]) if c.startswith("md:") else new_code_cell(c.strip("\n"))
                             for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, HERE / name)


write("01_beta_bernoulli_matching.ipynb", [
    """md:# 1. The Beta-Bernoulli neuron model and Hungarian MAP matching

PFNM (Yurochkin et al., ICML 2019) treats the hidden neurons of J locally trained networks as noisy copies of a
shared, unknown set of *global neurons* (atoms). Which atoms a client uses is decided by a Beta-Bernoulli process
(the Indian buffet process); a client's neurons come in an arbitrary order. The server *matches* them: it assigns
every local neuron to a global atom by maximising the posterior, one client at a time, with the Hungarian algorithm.

This notebook samples a federated layer from the model (a Pyro program), matches it, checks recovery, and then swaps
the atom prior for another distribution in a few lines.""",
    """
import os

import matplotlib.pyplot as plt
import pyro
import pyro.distributions as dist
import torch
from sklearn.metrics import adjusted_rand_score

from bnpfed.inference import match_layer
from bnpfed.models import beta_bernoulli_layer, log_joint, sample_federated_layer

QUICK = os.environ.get("BNPFED_TUTORIAL_QUICK") == "1"  # the test suite runs a reduced size
J = 6 if QUICK else 10
""",
    """md:## The generative model is a Pyro program

`beta_bernoulli_layer` has one `pyro.sample` site per random quantity: for client `j`, `z_j` (which earlier atoms it
uses), `new_j` (how many atoms it opens, Poisson(gamma0 / (j+1))), `theta_j` (those atoms), `perm_j` (the order its
neurons are reported in) and `v_j` (its neurons). A trace shows them:""",
    """
from pyro.poutine.util import site_is_subsample

trace = pyro.poutine.trace(beta_bernoulli_layer).get_trace(3, 2, gamma0=3.0, sigma2=0.01)
for name, site in trace.nodes.items():
    if site["type"] == "sample" and not site_is_subsample(site):
        print(f"{name:10s} {str(site['fn'].__class__.__name__):22s} shape {tuple(site['value'].shape)}")
""",
    """md:## Sample a federated layer in 2-D and look at it

Each colour is a global atom; dots are the clients' noisy copies, crosses the atoms themselves.""",
    """
layer = sample_federated_layer(J, 2, seed=0, gamma0=4.0, sigma2=0.005, sigma0_2=1.0)
print(f"{layer.num_atoms} atoms; neurons per client: {[v.shape[0] for v in layer.neurons]}")
print("clients per atom (m_i):", layer.counts.tolist())

fig, ax = plt.subplots(figsize=(5, 5))
cmap = plt.get_cmap("tab20")
for v, a in zip(layer.neurons, layer.assignments):
    ax.scatter(v[:, 0], v[:, 1], c=[cmap(int(i) % 20) for i in a], s=18)
ax.scatter(layer.atoms[:, 0], layer.atoms[:, 1], marker="x", c="k", s=60, label="atoms")
ax.legend(); ax.set_title("a federated layer sampled from the model"); plt.show()
""",
    """md:## Match it

`match_layer` runs a greedy pass over the clients, then sweeps that remove one client at a time and re-match it
given all the others (one `linear_sum_assignment` per client). The result carries the global atoms (posterior
means), each client's assignment and the objective after every sweep.

In two dimensions the evidence that two neurons share an atom is weak, so we use the objective that integrates the
atoms out (`objective="marginal"`); the next section shows why the published one needs more dimensions or a larger
`sigma2`.""",
    """
result = match_layer(layer.neurons, sigma2=0.005, sigma0_2=1.0, gamma0=4.0, seed=0, objective="marginal")
truth, found = torch.cat(layer.assignments), torch.cat(result.assignments)
print(f"true atoms {layer.num_atoms}, found {result.num_atoms}, "
      f"adjusted Rand index {adjusted_rand_score(truth, found):.3f}")
print("objective after the greedy pass and each sweep:", [round(f, 2) for f in result.objective])

fig, ax = plt.subplots(figsize=(5, 5))
ax.scatter(layer.atoms[:, 0], layer.atoms[:, 1], marker="x", c="k", s=80, label="true atoms")
ax.scatter(result.global_atoms[:, 0], result.global_atoms[:, 1], facecolors="none", edgecolors="r", s=120,
           label="matched global neurons")
ax.legend(); plt.show()
""",
    """md:## Recovery in higher dimension, and the objective's limit

The published objective plugs in the atoms' MAP values and drops their normalising constants. At `sigma2` equal to
the true noise, merging two copies of one atom and keeping them apart are then worth about the same, and it
over-splits. `objective="marginal"` integrates the atoms out (the Occam factor) and recovers the truth there;
the published objective needs `sigma2` above the true noise.""",
    """
D = 50
big = sample_federated_layer(J, D, seed=1, gamma0=20.0, sigma2=0.01, sigma0_2=1.0)
rows = []
for objective, sigma2 in [("map", 0.01), ("map", 0.02), ("marginal", 0.01)]:
    r = match_layer(big.neurons, sigma2=sigma2, sigma0_2=1.0, gamma0=20.0, objective=objective, seed=0)
    ari = adjusted_rand_score(torch.cat(big.assignments), torch.cat(r.assignments))
    rows.append((objective, sigma2, big.num_atoms, r.num_atoms, round(ari, 3)))
print("objective  sigma2  true  found  ARI")
for row in rows:
    print("{:9s}  {:6.3f}  {:4d}  {:5d}  {:.3f}".format(*row))
""",
    """md:## Swap the atom prior

The atom prior is an argument: any distribution over one atom in R^D. Here the atoms are Laplace (heavier tails),
and the local noise Student-t. Sampling and the log joint (a conditioned Pyro trace) work unchanged.""",
    """
laplace = dist.Laplace(torch.zeros(2), 0.7)
def student_t_noise(loc, variance):
    return dist.StudentT(3.0, loc, variance.sqrt())

heavy = sample_federated_layer(J, 2, seed=0, gamma0=30.0, sigma2=0.005, atom_prior=laplace, noise=student_t_noise)
gauss = sample_federated_layer(J, 2, seed=0, gamma0=30.0, sigma2=0.005, sigma0_2=2 * 0.7 ** 2)  # same variance

fig, axes = plt.subplots(1, 2, figsize=(9, 3))
axes[0].hist(gauss.atoms.flatten(), bins=40, alpha=0.6, label="Gaussian prior")
axes[0].hist(heavy.atoms.flatten(), bins=40, alpha=0.6, label="Laplace prior")
axes[0].legend(); axes[0].set_title("atom coordinates")
axes[1].scatter(heavy.atoms[:, 0], heavy.atoms[:, 1], s=8); axes[1].set_title("Laplace atoms")
plt.show()

print("log joint under the model it came from:", float(log_joint(heavy, gamma0=30.0, sigma2=0.005,
                                                                  atom_prior=laplace, noise=student_t_noise)))
print("log joint under the Gaussian model:    ", float(log_joint(heavy, gamma0=30.0, sigma2=0.005,
                                                                  sigma0_2=2 * 0.7 ** 2)))
""",
    """md:The Gaussian case is the one `match_layer` solves in closed form; with other priors the same Pyro program
gives the densities that an alternative matcher (or an MCMC sampler over assignments) would score.""",
])
