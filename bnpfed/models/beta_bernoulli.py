"""The Beta-Bernoulli (Indian buffet) process over neurons: the generative story of PFNM.

Yurochkin et al., "Bayesian Nonparametric Federated Learning of Neural Networks", ICML 2019, section 3. A layer of
a neural network is a set of neurons; a neuron is a vector in R^D (its incoming weights, its bias and, when the
layer above is already matched, its outgoing weights). Across J clients the story is:

* global neurons (atoms) ``theta_i ~ N(mu0, sigma0_2 I)`` in R^D, ``mu0`` possibly different per coordinate;
* a Beta-Bernoulli process with mass ``gamma0`` and concentration ``c`` (1 unless ``concentration`` says otherwise)
  decides which atoms client j uses. With the Beta process' weights integrated out it is the Indian buffet process
  (Griffiths & Ghahramani 2011; with c the two-parameter IBP of Ghahramani, Griffiths & Sollich 2007), written here
  in its sequential form: client j (counting from 1) takes each atom already used by m_i of the first j - 1 clients
  with probability ``m_i / (c + j - 1)`` and opens ``Poisson(gamma0 c / (c + j - 1))`` new ones. This form needs
  **no truncation**: the number of atoms is finite with probability one (its mean is ``gamma0 sum_{j=1}^J c / (c + j
  - 1)``, ``gamma0 H_J`` at c = 1, H_J the J-th harmonic number), and every client uses ``gamma0`` atoms on average.
  A larger c shares atoms less: more atoms, each held by fewer clients;
* each atom that client j uses gives one local neuron ``v_jl ~ N(theta_i, sigma2 / s_j)`` with per-coordinate
  precision scales ``s_j`` (1 by default; PFNM's output-layer coordinates use the client's class shares);
* a client's neurons come in a uniformly random order (``perm_j``): hidden units are permutation invariant, and
  matching is what undoes this permutation.

**Bayesian neurons** (``neuron_variance`` given). A client that trained a variational Bayesian network reports, for
each of its neurons, posterior means and posterior variances. Each neuron first draws its posterior-variance vector
``u_jl ~ neuron_variance`` (in R^D, entries >= 0; 0 for a deterministic coordinate such as a bias), and then its
mean ``v_jl ~ N(theta_i, (u_jl + tau2) / s_j)`` (the precision scales divide the whole variance, as the matcher's
noise precision ``w = s / (u + tau2)`` has it): the heteroscedastic model of
:mod:`bnpfed.matching.bayesian_layer`, ``tau2`` the extra variance of a unit across clients that the posterior
variances alone understate. Without ``neuron_variance`` this is the
homoscedastic model above (u = 0). The density of the ``u_j`` sites does not depend on the assignment or the atoms,
so it is a constant of any matching objective.

**A size prior.** A network of L atoms of D coordinates each holds L D parameters; multiplying the IBP prior by
``exp(-lambda L D)`` (a price of lambda nats per parameter) gives ``gamma0^L exp(-lambda L D) = (gamma0 e^{-lambda
D})^L`` times terms free of L, i.e. this same program with mass ``gamma0 exp(-lambda D)`` (and a constant). So a
global network of a size asked for (``max_width``, ``max_params`` of :func:`~bnpfed.matching.match_by_spec`) is
this model at a lower mass, ``gamma0 exp(-t)``, found by :mod:`bnpfed.matching.size`; one program serves both.

A client may use no atom at all (its number of atoms is Poisson(gamma0) marginally, so with probability
``exp(-gamma0)``): it then has no neurons, an empty assignment and no ``perm_j`` / ``v_j`` sites, and it still counts
in J -- the later clients' ``m_i / j`` and ``gamma0 / j`` count it, and so do the densities below.

Sites, for client ``j = 0 .. J-1`` (a site with nothing to sample is left out, as Pyro plates cannot be empty):

``z_j``      (L,) Bernoulli: which of the L atoms opened by earlier clients client j uses
``new_j``    ()   Poisson(gamma0 / (j + 1)): how many atoms client j opens
``theta_j``  (new_j, D): the atoms client j opens, from ``atom_prior``
``perm_j``   (L_j,) uniform permutation: the order in which client j's neurons are reported
``u_j``      (L_j, D): client j's neurons' posterior variances, from ``neuron_variance`` (only when it is given)
``v_j``      (L_j, D): client j's neurons (posterior means), from ``noise``

Atoms are labelled in order of first use (client 0's new atoms first). A trace of this program has density
``p_seq`` with the IBP prior in its *sequential, labelled* form:

    log p_seq(Z) = L log(gamma0 c) - gamma0 sum_{j=1}^J c / (c + j - 1) + sum_i log B(m_i, J - m_i + c)
                   - sum_j log K_j!

where m_i counts the clients using atom i, K_j the atoms first used by client j and B the Beta function; at c = 1
it is ``L log gamma0 - gamma0 H_J + sum_i log[(m_i - 1)! (J - m_i)! / J!] - sum_j log K_j!``. The K_j! orderings of a
client's new atoms are distinct traces of one configuration (which neurons share an atom, and the atoms' values), so
the density of a *configuration* is ``p_seq * prod_j K_j!``; :func:`log_joint` returns either.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from torch import Tensor

from bnpfed.validation import check_int, check_positive

__all__ = [
    "FederatedLayer",
    "UniformPermutation",
    "beta_bernoulli_layer",
    "sample_federated_layer",
    "log_joint",
    "canonical_conditioning",
    "gaussian_noise",
]


class UniformPermutation(dist.TorchDistribution):
    """Uniform distribution over the permutations of ``range(n)``: ``log p(perm) = -log n!``.

    :param int n: number of items permuted.
    """

    arg_constraints: dict = {}
    has_enumerate_support = False

    def __init__(self, n: int, validate_args=None):
        self.n = int(n)
        super().__init__(batch_shape=torch.Size(), event_shape=torch.Size([self.n]), validate_args=validate_args)

    @constraints.dependent_property
    def support(self):
        return constraints.independent(constraints.integer_interval(0, max(self.n - 1, 0)), 1)

    def sample(self, sample_shape=torch.Size()):
        if sample_shape != torch.Size():
            return torch.stack([torch.randperm(self.n) for _ in range(int(torch.Size(sample_shape).numel()))]).reshape(
                *sample_shape, self.n
            )
        return torch.randperm(self.n)

    def log_prob(self, value):
        value = torch.as_tensor(value)
        is_perm = (torch.sort(value, dim=-1).values == torch.arange(self.n, device=value.device)).all(-1)
        lp = torch.full(is_perm.shape, -math.lgamma(self.n + 1), dtype=torch.get_default_dtype())
        return torch.where(is_perm, lp, torch.full_like(lp, -math.inf))


def gaussian_noise(loc: Tensor, variance: Tensor) -> dist.Distribution:
    """Default local-neuron noise: independent ``N(loc, variance)`` per coordinate."""
    return dist.Normal(loc, variance.sqrt())


@dataclass(frozen=True)
class FederatedLayer:
    """One layer across J clients, with its ground truth.

    :param Tensor atoms: (L, D) global neurons theta, labelled in order of first use.
    :param list assignments: J long tensors; ``assignments[j][l]`` is the atom behind client j's l-th neuron (empty
        for a client without neurons).
    :param list neurons: J tensors (L_j, D), each client's neurons in their reported (permuted) order; (0, D) for a
        client without neurons.
    :param list variances: optional J tensors (L_j, D), the neurons' posterior variances u_j (Bayesian neurons,
        ``neuron_variance`` of :func:`beta_bernoulli_layer`); None for the homoscedastic model.
    """

    atoms: Tensor
    assignments: list
    neurons: list
    variances: list | None = None

    @property
    def num_clients(self) -> int:
        return len(self.neurons)

    @property
    def num_atoms(self) -> int:
        return int(self.atoms.shape[0])

    @property
    def counts(self) -> Tensor:
        """(L,) number of clients using each atom (m_i)."""
        used = [torch.as_tensor(a).reshape(-1).long() for a in self.assignments]
        if not used:
            return torch.zeros(self.num_atoms, dtype=torch.long)
        return torch.bincount(torch.cat(used), minlength=self.num_atoms)


def _as_vector(value, dim: int, name: str) -> Tensor:
    t = torch.as_tensor(value, dtype=torch.get_default_dtype())
    if t.dim() == 0:
        return t.expand(dim).clone()
    if t.shape != (dim,):
        raise ValueError(f"{name}: expected a scalar or shape ({dim},), got shape {tuple(t.shape)}")
    return t


def _precision_matrix(precisions, num_clients: int, dim: int) -> Tensor:
    if precisions is None:
        return torch.ones(num_clients, dim)
    s = torch.stack([torch.as_tensor(p, dtype=torch.get_default_dtype()) for p in precisions])
    if s.shape != (num_clients, dim):
        raise ValueError(f"precisions: expected shape ({num_clients}, {dim}) (one (D,) vector per client), "
                         f"got {tuple(s.shape)}")
    if not torch.isfinite(s).all() or (s <= 0).any():
        bad = (~(torch.isfinite(s) & (s > 0))).nonzero()[0].tolist()
        raise ValueError(f"precisions: expected finite entries > 0, got {s[tuple(bad)].item()} at index {tuple(bad)}")
    return s


def _one_neuron_law(law: dist.Distribution, D: int, name: str) -> dist.Distribution:
    """``law`` as a distribution with event shape (D,): one vector in R^D."""
    if law.event_shape == torch.Size():
        if law.batch_shape not in (torch.Size(), torch.Size([D])):
            raise ValueError(f"{name}: expected a law of one vector in R^{D}, got batch shape {tuple(law.batch_shape)}")
        law = law.expand(torch.Size([D])).to_event(1)
    if law.event_shape != torch.Size([D]):
        raise ValueError(f"{name}: expected a law of one vector in R^{D}, got event shape {tuple(law.event_shape)}")
    return law


def beta_bernoulli_layer(
    num_clients: int,
    dim: int,
    *,
    gamma0: float,
    sigma2: float | None = None,
    sigma0_2: float = 1.0,
    mu0=0.0,
    precisions=None,
    atom_prior: dist.Distribution | None = None,
    noise: Callable[[Tensor, Tensor], dist.Distribution] = gaussian_noise,
    neuron_variance: dist.Distribution | None = None,
    tau2: float | None = None,
    concentration: float = 1.0,
) -> FederatedLayer:
    """Pyro program of one federated layer under the Beta-Bernoulli process (see the module docstring).

    Usage::

        >>> layer = beta_bernoulli_layer(5, 20, gamma0=8.0, sigma2=0.01)      # a draw (under Pyro's RNG)
        >>> layer.num_clients, layer.atoms.shape[1]
        (5, 20)
        >>> trace = pyro.poutine.trace(beta_bernoulli_layer).get_trace(5, 20, gamma0=8.0, sigma2=0.01)
        >>> trace.nodes["new_0"]["fn"]                                         # client 0 opens Poisson(gamma0) atoms
        Poisson(rate: 8.0)
        >>> laplace = dist.Laplace(torch.zeros(20), 1.0)                      # swap the atom prior
        >>> layer = beta_bernoulli_layer(5, 20, gamma0=8.0, sigma2=0.01, atom_prior=laplace)

    Conditioning fixes any site; here client 0 uses no atom, so it has no neurons and the next client opens
    ``Poisson(gamma0 / 2)`` atoms::

        >>> data = {"new_0": torch.tensor(0.0), "new_1": torch.tensor(2.0)}
        >>> layer = pyro.poutine.condition(beta_bernoulli_layer, data=data)(2, 3, gamma0=1.0, sigma2=0.1)
        >>> [tuple(v.shape) for v in layer.neurons], layer.num_atoms
        ([(0, 3), (2, 3)], 2)

    Bayesian neurons: each neuron draws its posterior variances ``u_j`` first, then its mean with variance
    ``u_j + tau2`` (``tau2`` the extra variance across clients, as the heteroscedastic matching names it)::

        >>> gamma = dist.Gamma(2.0, 200.0).expand([20])                      # posterior variances, mean 0.01
        >>> model = pyro.poutine.condition(beta_bernoulli_layer, data={"new_0": torch.tensor(3.0)})
        >>> trace = pyro.poutine.trace(model).get_trace(5, 20, gamma0=8.0, tau2=0.001, neuron_variance=gamma)
        >>> layer = trace.nodes["_RETURN"]["value"]
        >>> tuple(trace.nodes["u_0"]["value"].shape), len(layer.variances)
        ((3, 20), 5)
        >>> torch.allclose(trace.nodes["v_0"]["fn"].base_dist.scale ** 2, layer.variances[0] + 0.001)
        True

    :param int num_clients: J.
    :param int dim: D, the length of a neuron vector.
    :param float gamma0: IBP mass; each client uses ``gamma0`` atoms on average.
    :param float sigma2: local noise variance (divided by the client's precision scales ``s_j``) of the homoscedastic
        model; required without ``neuron_variance``, and refused with it (the role is then ``tau2``'s).
    :param float sigma0_2: variance of the default Gaussian atom prior.
    :param mu0: mean of the default atom prior: a scalar or a (D,) vector (PFNM: 0 for weights, 0.1 for biases).
    :param precisions: optional J per-client (D,) precision scales s_j (default all 1).
    :param atom_prior: distribution of one atom in R^D (event or batch shape (D,)); default
        ``Normal(mu0, sqrt(sigma0_2))``. ``mu0`` and ``sigma0_2`` are ignored when it is given.
    :param noise: ``noise(loc, variance) -> Distribution`` with batch shape of ``loc`` (L_j, D): the law of a local
        neuron around its atom; default independent Gaussians.
    :param neuron_variance: optional law of one neuron's posterior-variance vector in R^D (event or batch shape
        (D,), support >= 0; e.g. ``dist.Gamma(2., 200.).expand([D])`` or a LogNormal). When given, every client with
        neurons gets a site ``u_j`` (L_j, D), sampled before ``v_j``, and ``v_j ~ noise(atoms, (u_j + tau2) / s_j)``
        (module docstring). None (default): the homoscedastic model, ``variances`` of the result None.
    :param float tau2: with ``neuron_variance`` (required then, refused without it): the extra variance of a unit
        across clients that the posterior variances understate, tau2 of
        :func:`~bnpfed.matching.match_bayesian_layer`.
    :param float concentration: c > 0 of the two-parameter IBP (default 1, the one-parameter IBP of PFNM): client j
        (from 1) takes an atom of m earlier users with probability ``m / (c + j - 1)`` and opens ``Poisson(gamma0 c /
        (c + j - 1))`` new ones (module docstring).
    :returns: :class:`FederatedLayer` with the sampled (or conditioned) atoms, assignments, neurons and (with
        ``neuron_variance``) posterior variances.
    """
    J, D = int(num_clients), int(dim)
    for name, value in (("num_clients", J), ("dim", D)):
        if value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value}")
    gamma0 = check_positive(gamma0, "gamma0")
    c = check_positive(concentration, "concentration")
    if neuron_variance is None:
        if tau2 is not None:
            raise ValueError(f"tau2: expected None without neuron_variance (the homoscedastic model's noise is "
                             f"sigma2), got {tau2!r}")
        extra = check_positive(sigma2, "sigma2")
    else:
        if sigma2 is not None:
            raise ValueError(f"sigma2: expected None with neuron_variance (the extra variance of Bayesian neurons is "
                             f"tau2), got {sigma2!r}; pass tau2={sigma2!r}")
        extra = check_positive(tau2, "tau2")
    if atom_prior is None:
        sigma0_2 = check_positive(sigma0_2, "sigma0_2")
        atom_prior = dist.Normal(_as_vector(mu0, D, "mu0"), math.sqrt(sigma0_2))
    if atom_prior.event_shape == torch.Size():
        if atom_prior.batch_shape not in (torch.Size(), torch.Size([D])):
            raise ValueError(f"atom_prior: expected a law of one atom in R^{D}, got batch shape "
                             f"{tuple(atom_prior.batch_shape)}")
        atom_prior = atom_prior.expand(torch.Size([D])).to_event(1)
    if atom_prior.event_shape != torch.Size([D]):
        raise ValueError(f"atom_prior: expected a law of one atom in R^{D}, got event shape "
                         f"{tuple(atom_prior.event_shape)}")
    scales = _precision_matrix(precisions, J, D)
    if neuron_variance is not None:
        neuron_variance = _one_neuron_law(neuron_variance, D, "neuron_variance")

    atoms = torch.zeros(0, D)
    counts = torch.zeros(0)
    assignments, neurons, variances = [], [], []
    for j in range(J):
        num_old = atoms.shape[0]
        if num_old:
            z = pyro.sample(f"z_{j}", dist.Bernoulli(counts / (c + j)).to_event(1))
        else:
            z = torch.zeros(0)
        num_new = int(pyro.sample(f"new_{j}", dist.Poisson(torch.tensor(gamma0 * c / (c + j)))))
        if num_new:
            with pyro.plate(f"atoms_{j}", num_new):
                theta_new = pyro.sample(f"theta_{j}", atom_prior)
            atoms = torch.cat([atoms, theta_new])
        used = torch.cat([torch.nonzero(z > 0.5).flatten(), torch.arange(num_old, num_old + num_new)])
        counts = torch.cat([counts, torch.zeros(num_new)])
        counts[used] += 1
        L_j = used.numel()
        if L_j == 0:
            assignments.append(torch.zeros(0, dtype=torch.long))
            neurons.append(torch.zeros(0, D))
            variances.append(torch.zeros(0, D))
            continue
        perm = pyro.sample(f"perm_{j}", UniformPermutation(L_j)).long()
        assign_j = used[perm]
        variance = (extra / scales[j]).expand(L_j, D)
        with pyro.plate(f"neurons_{j}", L_j):
            if neuron_variance is not None:
                u = pyro.sample(f"u_{j}", neuron_variance)
                variance = (u + extra) / scales[j]
                variances.append(u)
            v = pyro.sample(f"v_{j}", noise(atoms[assign_j], variance).to_event(1))
        assignments.append(assign_j)
        neurons.append(v)
    return FederatedLayer(atoms=atoms, assignments=assignments, neurons=neurons,
                          variances=variances if neuron_variance is not None else None)


def sample_federated_layer(num_clients: int, dim: int, *, seed: int, gamma0: float, **model_kwargs) -> FederatedLayer:
    """Draw a federated layer from :func:`beta_bernoulli_layer` with a seed (the global RNG is left untouched).

    :param int num_clients: J.
    :param int dim: D, the length of a neuron vector.
    :param int seed: the draw's seed, >= 0.
    :param float gamma0: the IBP mass (required, as :func:`beta_bernoulli_layer`'s).
    :param model_kwargs: the other keywords of :func:`beta_bernoulli_layer` (``sigma2``, ``sigma0_2``, ...); another
        name is refused (``ValueError`` naming it) before anything is drawn.

    Usage::

        >>> layer = sample_federated_layer(10, 50, seed=0, gamma0=20.0, sigma2=0.01)
        >>> layer.num_atoms, tuple(layer.atoms.shape), [tuple(v.shape) for v in layer.neurons[:2]]
        (49, (49, 50), [(19, 50), (23, 50)])
        >>> same = sample_federated_layer(10, 50, seed=0, gamma0=20.0, sigma2=0.01)
        >>> torch.equal(same.atoms, layer.atoms)
        True
    """
    check_int(seed, "seed", low=0)
    known = [name for name, p in inspect.signature(beta_bernoulli_layer).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "gamma0"]
    unknown = sorted(set(model_kwargs) - set(known))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a keyword of beta_bernoulli_layer; expected gamma0 and any of "
                         f"{', '.join(known)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return beta_bernoulli_layer(num_clients, dim, gamma0=gamma0, **model_kwargs)


def canonical_conditioning(neurons: Sequence[Tensor], assignments: Sequence[Tensor], atoms: Tensor,
                           variances: Sequence[Tensor] | None = None) -> dict:
    """The values of every site of :func:`beta_bernoulli_layer` that produce the given layer.

    Atoms may carry any labels: they are relabelled in order of first use (client by client, and within a client
    by the position of the first neuron that uses them), which is the labelling the sequential IBP generates. A
    client without neurons (an empty assignment, neurons of shape (0, D)) gets ``z_j`` all 0 and ``new_j`` = 0.

    :param neurons: J tensors (L_j, D).
    :param assignments: J integer sequences of length L_j, distinct within a client.
    :param Tensor atoms: (L, D), every atom used by some client.
    :param variances: optional J tensors (L_j, D), the neurons' posterior variances: the values of the ``u_j`` sites
        (a model with ``neuron_variance``).
    :returns: dict site name -> value, for ``pyro.poutine.condition``.
    """
    J = len(neurons)
    if len(assignments) != J:
        raise ValueError(f"assignments: expected one per client ({J}, as many as neurons), got {len(assignments)}")
    if variances is not None and len(variances) != J:
        raise ValueError(f"variances: expected one per client ({J}, as many as neurons), got {len(variances)}")
    atoms = torch.as_tensor(atoms, dtype=torch.get_default_dtype())
    if atoms.dim() != 2:
        raise ValueError(f"atoms: expected shape (L, D), got {tuple(atoms.shape)}")
    relabel: dict[int, int] = {}
    data: dict = {}
    for j in range(J):
        a = [int(x) for x in torch.as_tensor(assignments[j]).reshape(-1).tolist()]
        if len(set(a)) != len(a):
            raise ValueError(f"assignments[{j}]: expected distinct atoms (a client uses an atom at most once), got {a}")
        shape = tuple(torch.as_tensor(neurons[j]).shape)
        if shape != (len(a), atoms.shape[1]):
            raise ValueError(f"neurons[{j}]: expected shape ({len(a)}, {atoms.shape[1]}) (one row per entry of "
                             f"assignments[{j}], one column per atom coordinate), got {shape}")
        num_old = len(relabel)
        if num_old:
            z = torch.zeros(num_old)
            for x in a:
                if x in relabel:
                    z[relabel[x]] = 1.0
            data[f"z_{j}"] = z
        new_labels = [x for x in a if x not in relabel]
        for x in new_labels:
            relabel[x] = len(relabel)
        data[f"new_{j}"] = torch.tensor(float(len(new_labels)))
        if new_labels:
            data[f"theta_{j}"] = atoms[torch.tensor(new_labels)]
        if a:
            canon = torch.tensor([relabel[x] for x in a])
            used = torch.sort(canon).values  # the model lists old atoms (ascending) then new ones (ascending)
            data[f"perm_{j}"] = torch.searchsorted(used, canon)
            data[f"v_{j}"] = torch.as_tensor(neurons[j], dtype=torch.get_default_dtype())
            if variances is not None:
                u = torch.as_tensor(variances[j], dtype=torch.get_default_dtype())
                if tuple(u.shape) != shape:
                    raise ValueError(f"variances[{j}]: expected shape {shape} (that of neurons[{j}]), got "
                                     f"{tuple(u.shape)}")
                data[f"u_{j}"] = u
    if len(relabel) != atoms.shape[0]:
        raise ValueError(f"atoms: expected {len(relabel)} rows, one per atom the assignments use, got "
                         f"{atoms.shape[0]}")
    return data


def log_joint(
    layer: FederatedLayer,
    *,
    configuration: bool = False,
    **model_kwargs,
) -> Tensor:
    """Log joint density of atoms + assignments + neurons, evaluated through Pyro (a conditioned trace).

    ``log p_seq = trace.log_prob_sum()`` of :func:`beta_bernoulli_layer` conditioned on every site (see
    :func:`canonical_conditioning`). With ``configuration=True`` adds ``sum_j log K_j!``: the density of the
    configuration (which neurons share an atom, and the atoms' values) rather than of one labelled trace.

    A layer with posterior variances (``layer.variances``, Bayesian neurons) conditions the ``u_j`` sites on them
    and needs the model's ``neuron_variance`` among ``model_kwargs`` (and one without them must not pass it). Their
    log density ``sum_j log neuron_variance(u_j)`` is free of the assignment and the atoms.

    Usage::

        >>> layer = sample_federated_layer(4, 10, seed=0, gamma0=5.0, sigma2=0.1)
        >>> lp = log_joint(layer, gamma0=5.0, sigma2=0.1)            # a scalar tensor
        >>> bool(lp > log_joint(layer, gamma0=5.0, sigma2=1.0))          # the noise it was drawn with fits best
        True

    By hand: one atom at 0 in R^1, held by client 0 with its neuron at 0, and client 1 without neurons. With gamma0 =
    sigma2 = sigma0_2 = 1 the IBP prior is ``log gamma0 - gamma0 H_2 + log[0! 1! / 2!]`` = -1.5 - log 2, each Gaussian
    density at its mean is ``-log(2 pi) / 2``, and client 0's one neuron has one order::

        >>> by_hand = FederatedLayer(atoms=torch.zeros(1, 1), assignments=[torch.tensor([0]), torch.tensor([])],
        ...                          neurons=[torch.zeros(1, 1), torch.zeros(0, 1)])
        >>> expected = -1.5 - math.log(2) - math.log(2 * math.pi)
        >>> math.isclose(float(log_joint(by_hand, gamma0=1.0, sigma2=1.0)), expected, rel_tol=1e-6)
        True
    """
    has_u, wants_u = layer.variances is not None, model_kwargs.get("neuron_variance") is not None
    if has_u != wants_u:
        raise ValueError("neuron_variance: expected a law of the posterior variances exactly when the layer has "
                         f"them (layer.variances {'given' if has_u else 'None'}), got "
                         f"{'None' if not wants_u else 'a law'}")
    data = canonical_conditioning(layer.neurons, layer.assignments, layer.atoms, variances=layer.variances)
    J = len(layer.neurons)
    D = int(layer.atoms.shape[1])
    conditioned = pyro.poutine.condition(beta_bernoulli_layer, data=data)
    trace = pyro.poutine.trace(conditioned).get_trace(J, D, **model_kwargs)
    lp = trace.log_prob_sum()
    if configuration:
        lp = lp + sum(math.lgamma(float(data[f"new_{j}"]) + 1) for j in range(J))
    return lp
