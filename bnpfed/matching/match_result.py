"""What matching one layer returns: :class:`MatchResult`, the global atoms, the assignment and how they were found.

Written by :class:`~bnpfed.matching.matcher.LayerMatcher` (through :func:`~bnpfed.matching.driver.run_matching`),
read by every network driver; in a file of its own so that a reader of the result does not open the matcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

__all__ = ["MatchResult"]


@dataclass
class MatchResult:
    """Result of :func:`~bnpfed.matching.layer.match_layer` and
    :func:`~bnpfed.matching.bayesian_layer.match_bayesian_layer`.

    :param Tensor global_atoms: (L, D) posterior means ``g_i / P_i`` given the assignment (at the final
        hyper-parameters); on the general path (a model that is not Gaussian) the atoms' MAP values.
    :param Tensor posterior_precision: (L, D) posterior precisions ``P_i`` (all coordinates shared: a read-only view);
        on the general path the curvatures ``-l''`` of the atoms' log densities at their MAP values (the Laplace
        approximation's precisions).
    :param list assignments: J long tensors of length L_j with values in [0, L), distinct within a client (empty
        for a client without neurons).
    :param Tensor counts: (L,) number of clients on each atom (m_i).
    :param list objective: the objective after the greedy pass (or at ``init_assignments``) and after every sweep,
        each at the hyper-parameters that pass used (the starting values for the first). With fixed hyper-parameters
        a sweep skipped at a fixed point repeats the last value (``sweeps + 1`` entries).
    :param float seconds: wall time of the matching.
    :param float lsa_seconds: part of ``seconds`` spent inside ``linear_sum_assignment``.
    :param list rematches: one ``(client, L_j, L)`` per client (re-)matching, L the atoms it was scored against.
    :param dict hyperparameters: the final values, estimated or given (``"mu0"`` a (D,) tensor, the variances and
        ``"gamma0"`` floats; ``"concentration"``, the two-parameter IBP's c, where it was estimated or is not 1; on
        the general path a :class:`~bnpfed.models.NoiseLaw`'s named parameters, and no ``"mu0"`` or ``"sigma0_2"``
        with an ``atom_prior`` given; the names are the matcher's: see its docstring).
    :param list hyperparameter_history: the values (dicts as ``hyperparameters``) after the first assignment and
        after every sweep; the last entry is ``hyperparameters``. With fixed hyper-parameters every entry holds the
        given values (as many as ``objective``).
    :param bool converged: empirical Bayes: whether a sweep changed no assignment and moved no estimate (by more than
        ``EB_RTOL``) before the sweep limit; always True with fixed hyper-parameters.
    :param tuple estimated: names of the estimated hyper-parameters; ``()`` with fixed ones. ``"mu0"`` is listed
        when any coordinate of it was estimated.
    :param list notes: what the estimation had to fall back on, and whether it stopped at the sweep limit; empty
        with fixed hyper-parameters.
    :param int sweeps_run: sweeps actually run after the first assignment.
    :param list moved: per sweep run, how many neurons did not stay with the others they were with.
    :param float log_likelihood: ``log p(Z, V)`` of the assignment at the final values, every normalising constant
        included (:meth:`LayerMatcher.log_likelihood`): comparable across hyper-parameters.
    :param list starts: empirical Bayes from both starts (:func:`~bnpfed.matching.driver.run_matching`): per start
        its ``start``, ``log_likelihood``, ``atoms``, ``sweeps`` and ``converged``; empty when there was one start.
    :param bool restarted: the small-noise start's first pass left every neuron alone and was redone from the even
        split.
    """

    global_atoms: Tensor
    posterior_precision: Tensor
    assignments: list
    counts: Tensor
    objective: list
    seconds: float = 0.0
    lsa_seconds: float = 0.0
    rematches: list = field(default_factory=list, repr=False)
    hyperparameters: dict = field(default_factory=dict)
    hyperparameter_history: list = field(default_factory=list, repr=False)
    converged: bool = True
    estimated: tuple = ()
    notes: list = field(default_factory=list)
    sweeps_run: int = 0
    moved: list = field(default_factory=list)
    log_likelihood: float | None = None
    starts: list = field(default_factory=list)
    restarted: bool = False

    @property
    def num_atoms(self) -> int:
        return int(self.global_atoms.shape[0])
