"""Probes: settings of the matcher, of matched fusion and of the Bayesian clients that were measured against the
defaults and found worse (slower for the same result, or less accurate), kept so that those measurements can be run
again and the records made before each default changed can be replayed. Nothing here is on unless a user passes it:

    >>> from bnpfed.experimental import ExperimentalOptions
    >>> from bnpfed.federated import PFNMConfig
    >>> PFNMConfig(experimental=ExperimentalOptions(starts="small-noise", inactive="keep")).starts
    'small-noise'

This is the folder's one public face: :class:`ExperimentalOptions` (one object; each config reads its own probes and
refuses the others), the text form ``bnpfed pfnm --experimental starts=both,stop=fixed-point`` and the Flower key
``experimental`` read (:meth:`ExperimentalOptions.from_text`), and :func:`reads_experimental`, which gives a config
its probes. The docs' benchmark pages (scale; fusion) hold the measurements.
"""

from bnpfed.experimental.options import (INACTIVE, LATER_ROUNDS, PVI_DAMPING, ROUND_PRIORS, ExperimentalOptions, keyed,
                                         reads_experimental)

__all__ = ["ExperimentalOptions", "INACTIVE", "LATER_ROUNDS", "PVI_DAMPING", "ROUND_PRIORS", "keyed",
           "reads_experimental"]
