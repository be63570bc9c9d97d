"""``bnpfed match``: pre-trained local networks in, one global network file out (PFNM's own use case: the models are
available, their data are not), through :func:`bnpfed.matching.match_by_spec` and :func:`bnpfed.saved.save_global`;
with ``--posteriors``, saved Bayesian clients (variational, :class:`~bnpfed.clients.BayesianClient`, or Laplace,
:class:`~bnpfed.clients.LaplaceClient`) in, one global posterior out, matched
(:func:`bnpfed.matching.posteriors.match_posteriors`) or weight by weight
(:func:`bnpfed.federated.server.fuse_posteriors`).

Examples::

    bnpfed match client0.pt client1.pt client2.pt --out global.pt          # whole modules (torch.save(net))
    bnpfed match c*.pt --arch lenet --input-shape 1,28,28 --counts counts.json --out global.pt   # state dicts
    bnpfed match c*.pt --module mypkg.nets:make_cnn --input-shape 3,32,32 --show-spec --out global.pt
    bnpfed match c*.pt --module mypkg.nets:make_resnet --input-shape 3,32,32 --out global.pt   # residual: derived too
    bnpfed match c*.pt --module mypkg.nets:make_net --input-shape 3,32,32 --spec spec.json --out global.pt
    bnpfed match c*.pt --counts counts.json --activity activity.json --out global.pt   # dead units left out
    bnpfed match c*.pt --counts counts.json --heads pooled --out global.pt   # label skew: the clients' heads pooled
    bnpfed match b*.pt --posteriors --rule conflation --out global.pt      # Bayesian clients (bnpfed.save_global)
    bnpfed match b*.pt --posteriors --align none --rule gaa --out global.pt   # clients from one shared init
    bnpfed match l*.pt --posteriors --match-on means --out global.pt     # Laplace clients (the default for them)
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from pathlib import Path

import torch
from torch import nn

from bnpfed.commands import _args, _options
from bnpfed.commands._args import HelpFormatter, UsageError, fail, flag_message
from bnpfed.federated import initial_network
from bnpfed.combine import available_rules
from bnpfed.federated import ARCHITECTURES, HEADS, FusionConfig, NetworkConfig, PFNMConfig, config_dict
from bnpfed.clients import LaplaceClient
from bnpfed.matching import MIN_VARIANCE
from bnpfed.validation import check_choice
from bnpfed.metrics import count_parameters
from bnpfed.report import command_record, command_results, format_table, write_json
from bnpfed.saved import FORMAT, global_from_record, load_torch_file, save_global

PROG = "bnpfed match"


def add_parser(sub):
    p = sub.add_parser(
        "match", help="match pre-trained local networks (files) into one global network file",
        description=_args.paragraphs(
            "Read J trained networks of one kind (whole pickled modules, torch.save(net); or state dicts with "
            "--arch or --module to rebuild them), derive their permutation spec and check it numerically, match "
            "their hidden units under the Beta-Bernoulli process (PFNM; empirical Bayes by default), and write the "
            "global network with its spec, widths per group, hyper-parameters and class shares to --out "
            "(bnpfed.load_global(path) reads it back). The files hold pickles: match only models you trust."),
        epilog=_args.examples(__doc__), formatter_class=HelpFormatter)
    _args.add_help_all(p)
    p.add_argument("models", nargs="+", metavar="MODEL", help="the clients' model files, one per client (J >= 2)")
    p.add_argument("--out", required=True, metavar="PATH", help="where to write the global network (.pt)")
    g = p.add_argument_group("the networks")
    g.add_argument("--arch", choices=ARCHITECTURES,
                   help="rebuild state-dict files as this bnpfed network (mlp: its widths read from each file)")
    g.add_argument("--module", metavar="PKG.MOD:FACTORY",
                   help="rebuild state-dict files with the user's own network: FACTORY() returns one (any widths)")
    g.add_argument("--input-shape", type=_args.ints, metavar="C,H,W",
                   help="the shape of one input (needed for a convolutional network; an MLP's is its first layer's "
                   "inputs)")
    g.add_argument("--counts", metavar="PATH",
                   help="JSON: a J x C table of each client's training examples per class (its class shares weigh "
                   "the output layer), or 'uniform' (every client holds every class equally). Default: estimated "
                   "from each network's own output layer (bnpfed.matching.class_shares), and the result says so")
    g.add_argument("--activity", metavar="PATH",
                   help="JSON: one report per client in MODEL order, each {group: [one activity per unit]} as "
                   "bnpfed.matching.unit_activity computes it on the client's own data; the units with activity 0 "
                   "(dead on that data) are left out before matching, as bnpfed pfnm leaves them out. Default: "
                   "every unit matched, dead ones included, and the result says so")
    g.add_argument("--spec", metavar="PATH",
                   help="JSON: the networks' permutation spec written by hand, for what derive_spec cannot read "
                   "({\"groups\": [{\"name\": ..., \"axes\": [[param, dim(, block)], ...]}, ...], \"kinds\": "
                   "{param: kind}}: bnpfed.matching.PermutationSpec.from_dict); checked numerically on the networks. "
                   "Default: derived from the network (residual additions included)")
    g.add_argument("--show-spec", action="store_true", help="print the permutation spec (derived or --spec's)")
    g = p.add_argument_group("matching", "as bnpfed pfnm; with --posteriors --align match the same but --sigma2 "
                             "(--tau2 instead)")
    names = ("sigma2", "sigma0_2", "gamma0", "hyperparameters", "sweeps", "max_width", "max_params", "heads",
             "matcher_device")
    _options.add_config_options(p, PFNMConfig, PFNMConfig(), group=g, only=names, show=names, helps={
        "sigma2": "the local noise variance, > 0: one value, or one per group ('auto' for a group estimated); not "
                  "with --posteriors",
        "max_width": "the most global units per group (one, or one per group, 'none' for no limit there), met "
                     "inside the model by lowering the group's IBP mass; not with --posteriors",
        "max_params": "the most parameters of the global network, or 'ensemble' (no more than the clients' networks "
                      "together), met by pricing every parameter in the prior; not with --posteriors",
        "heads": "the global network's output layer: fused (PFNM's class-share average of the clients' output "
                 "layers) or pooled (every client's own output layer on the global units its units were matched to, "
                 "log-probabilities pooled with the class shares: bnpfed.matching.pooled_network; J output layers "
                 "instead of one, for label skew); with --posteriors (--align match) the clients' own posterior "
                 "output layers, pooled inside every weight draw (bnpfed.matching.PooledPosterior)"},
        defaults={"max_params": "none (the model's own size)"})
    g.add_argument("--seed", type=int, default=0, help="seed of the sweeps' client order (and of the pooling rule's "
                   "draws), >= 0")
    g = p.add_argument_group("posterior fusion (--posteriors)", "the MODEL files are Bayesian clients (variational "
                             "BayesianClient or post-hoc LaplaceClient, all of one kind) saved by "
                             "bnpfed.save_global(path, client, method=...) or bnpfed fuse --save-global: their "
                             "posteriors are fused into one global posterior, written with the clients' prior (a "
                             "Laplace global keeps the linearised predictive)")
    g.add_argument("--posteriors", action="store_true",
                   help="fuse the posteriors of saved Bayesian clients instead of matching deterministic networks")
    names = ("rule", "align", "tau2", "match_on", "pooling_samples", "min_variance")
    _options.add_config_options(p, FusionConfig, FusionConfig(), group=g, only=names, show=names, helps={
        "rule": f"the fusion rule of bnpfed.combine, one of {', '.join(available_rules())} (or a registered one)",
        "align": "match: match the clients' hidden units (Beta-Bernoulli model, on what --match-on says) and fuse "
                 "every global unit's members; none: fuse weight i of every client with weight i of the others "
                 "(clients of one shared initialisation and one width only)",
        "tau2": "--align match: the extra variance between two clients' copies of a unit, > 0 (with --match-on "
                "means the noise variance sigma2 of PFNM's model)",
        "min_variance": "a floor on every fused variance, > 0"},
        defaults={"align": "match", "min_variance": f"{MIN_VARIANCE:g} with --align match, "
                                                    f"{FusionConfig().min_variance:g} with --align none"})
    g.add_argument("--json", metavar="PATH", help="also write the widths and hyper-parameters as JSON")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------------------------ reading


def _factory(spec: str):
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"--module: expected PKG.MOD:FACTORY, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"--module: cannot import {spec!r} ({type(error).__name__}: {error})") from None
    if not callable(factory):
        raise UsageError(f"--module: expected a callable that returns a network, got {type(factory).__name__}")
    return factory


def _read(path: str):
    """One client's file: an ``nn.Module`` or a state dict (a mapping of tensors), and the preprocessing of its
    inputs when the file records it (a file of :func:`~bnpfed.saved.save_global`), else None."""
    try:
        obj = load_torch_file(path, name="MODEL", what="a model file")
    except ValueError as error:
        raise UsageError(str(error)) from None
    if isinstance(obj, nn.Module):
        return obj, None
    if isinstance(obj, dict) and obj.get("format") == FORMAT:  # a file bnpfed wrote (save_global)
        if obj.get("kind") in ("bayesian", "laplace"):
            raise UsageError(f"MODEL: {path!r} holds a Bayesian client; expected --posteriors to fuse Bayesian "
                             "clients")
        try:
            saved = global_from_record(obj, path)
        except ValueError as error:
            raise UsageError(f"MODEL: {str(error).split(': ', 1)[-1]}") from None
        return saved.network, saved.inputs
    if isinstance(obj, dict) and obj and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
        return {k: v.detach().clone() for k, v in obj.items()}, None
    raise UsageError(f"MODEL: expected a network (torch.save(net)) or its state dict in {path!r}, got "
                     f"{type(obj).__name__}")


def _common_inputs(paths, inputs: list) -> tuple:
    """The preprocessing the clients' files record (:class:`~bnpfed.data.Preprocessing` or None), for the global
    model, and what the result says about it: ``(inputs, notes)``. Clients trained on inputs prepared differently
    (other constants, another shape) are refused: their units answer to different inputs."""
    recorded = [(path, i) for path, i in zip(paths, inputs) if i is not None]
    if not recorded:
        return None, ["the MODEL files do not record how their inputs were prepared, so neither does the global "
                      "model (bnpfed evaluate says so, and takes --standardize / --no-standardize)"]
    first_path, first = recorded[0]
    for path, other in recorded[1:]:
        if (other.input_shape, other.num_classes, other.mean, other.std) != (first.input_shape, first.num_classes,
                                                                            first.mean, first.std):
            raise UsageError(f"MODEL: {path!r} was trained on inputs of shape {other.input_shape}, "
                             f"{other.describe()}, {other.num_classes} classes, and {first_path!r} on "
                             f"{first.input_shape}, {first.describe()}, {first.num_classes} classes; expected clients "
                             "whose inputs were prepared alike")
    notes = []
    names = sorted({i.dataset for _, i in recorded})
    if len(names) > 1:
        notes.append(f"the clients were trained on different datasets ({', '.join(names)}); the global model "
                     f"records {first.dataset}'s")
    if len(recorded) < len(paths):
        notes.append(f"{len(paths) - len(recorded)} of the {len(paths)} MODEL files record no preprocessing; the "
                     f"global model records the others' ({first.describe()})")
    return first, notes


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (the same path, or links to one file)."""
    a, b = Path(a).expanduser(), Path(b).expanduser()
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def _mlp_widths(state: dict) -> tuple[int, ...]:
    weights = [v for v in state.values() if v.dim() == 2]
    return tuple(int(w.shape[0]) for w in weights[:-1])


def _template(args, first, input_shape):
    """A network of the clients' kind (the global one is built from it) and one input's shape."""
    if isinstance(first, nn.Module):
        net = first
    elif args.module is not None:
        net = _factory(args.module)()
        if not isinstance(net, nn.Module):
            raise UsageError(f"--module: expected FACTORY() to return a torch.nn.Module, got {type(net).__name__}")
    else:
        weights = [v for v in first.values() if v.dim() >= 2]
        classes = int(weights[-1].shape[0])
        if args.arch == "mlp":
            shape = input_shape or (int(weights[0].shape[1]),)
            net = initial_network(NetworkConfig(arch="mlp", hidden=_mlp_widths(first)), shape, classes, seed=0)
            return net, shape
        if input_shape is None:
            raise UsageError(f"--input-shape: expected the shape of one input (C,H,W) for --arch {args.arch}")
        net = initial_network(NetworkConfig(arch=args.arch), input_shape, classes, seed=0)
    return net, _input_shape(net, input_shape)


def _input_shape(net: nn.Module, given) -> tuple:
    """``--input-shape`` as given, or an MLP's (its first layer's inputs); a convolutional network needs it."""
    if given is not None:
        return tuple(given)
    linear = [m for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    if not linear or not isinstance(linear[0], nn.Linear):
        raise UsageError("--input-shape: expected the shape of one input (C,H,W) for a convolutional network")
    return (linear[0].in_features,)


def _read_spec(path: str):
    """The permutation spec in a JSON file (:meth:`~bnpfed.matching.PermutationSpec.to_dict`'s format), or a
    UsageError naming --spec."""
    from bnpfed.matching import PermutationSpec

    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise UsageError(f"--spec: cannot read {path!r} ({error.strerror or error})") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"--spec: expected a JSON file, got {path!r}, which is not JSON ({error})") from None
    try:
        return PermutationSpec.from_dict(data, where="--spec")
    except ValueError as error:
        raise UsageError(_args.one_line(error)) from None


def _checked_spec(template: nn.Module, input_shape, spec_path: str | None = None):
    """The template's permutation spec, read from ``spec_path`` (``--spec``) or derived, and verified, or a
    UsageError naming --spec or the MODEL files."""
    from bnpfed.matching import derive_spec, verify_spec

    if spec_path is not None:
        spec = _read_spec(spec_path)
        try:
            verify_spec(template, spec, input_shape)
        except ValueError as error:
            raise UsageError(f"--spec: {spec_path!r} does not describe these networks: "
                             f"{_args.one_line(error)}") from None
        return spec
    try:
        spec = derive_spec(template, input_shape)
        verify_spec(template, spec, input_shape)
    except ValueError as error:
        if str(error).startswith("input_shape:"):   # the flag's value, or the MLP's inputs it was read from
            raise UsageError(f"--input-shape: {_args.one_line(str(error).split(': ', 1)[1])}") from None
        raise UsageError(f"MODEL: cannot match these networks: {_args.one_line(error)} (or give the spec with "
                         f"--spec FILE)") from None
    return spec


def _check_alike(paths, nets: list, spec, first_state: dict) -> None:
    """Every client is the first's kind of network: the same modules, layer for layer (an activation counts: a
    Tanh network is not a ReLU network), and the same number of classes (output units). Their hidden widths may
    differ."""
    from bnpfed.matching import architecture_difference

    if isinstance(nets[0], nn.Module):
        for path, net in zip(paths[1:], nets[1:]):
            where = architecture_difference(nets[0], net)
            if where is not None:
                raise UsageError(f"MODEL: {path!r} is another architecture than {paths[0]!r}: its {where}; "
                                 "expected networks of one kind")
    outputs = spec.params_of_kind("output_weight")
    if not outputs:
        return
    name = outputs[0]
    for path, net in zip(paths, nets):
        state = net.state_dict() if isinstance(net, nn.Module) else net
        if name in state and state[name].shape[0] != first_state[name].shape[0]:
            raise UsageError(f"MODEL: {path!r} has {state[name].shape[0]} output classes ({name}) and {paths[0]!r} "
                             f"{first_state[name].shape[0]}; expected clients of one set of classes")


def _activity(path, states: list, spec) -> list | None:
    """``--activity``: the clients' reports (one ``{group: (L,) float64 tensor}`` per client), checked against the
    spec and every client's widths (:func:`~bnpfed.matching.activity.kept_per_client`); None without the flag."""
    from bnpfed.matching import kept_per_client
    from bnpfed.matching import width

    if path is None:
        return None
    J = len(states)
    try:
        reports = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"--activity: expected a JSON file of {J} reports, got {path!r} ({type(error).__name__})") \
            from None
    if not (isinstance(reports, list) and len(reports) == J and all(isinstance(r, dict) for r in reports)):
        raise UsageError(f"--activity: expected a JSON list of {J} reports (one per MODEL, each {{group: [activity "
                         f"per unit]}}), got {type(reports).__name__}"
                         f"{f' of length {len(reports)}' if isinstance(reports, list) else ''}")
    out = []
    for j, report in enumerate(reports):
        for group, values in report.items():
            if not (isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                     for v in values)):
                raise UsageError(f"--activity: report {j} (of {path!r}), group {group!r}: expected a list of numbers, "
                                 f"got {type(values).__name__}")
        out.append({g: torch.tensor(v, dtype=torch.float64) for g, v in report.items()})
    widths = [{g.name: width(state, g, "MODEL") for g in spec.groups} for state in states]
    try:
        kept_per_client(out, spec, widths)
    except ValueError as error:
        raise UsageError(f"--activity: {_args.one_line(error)} (groups of the spec: {', '.join(spec.group_names)})") \
            from None
    return out


def _activity_notes(activity) -> list[str]:
    """What the result says about dead units."""
    if activity is None:
        return ["no --activity: every unit matched, dead ones included (give the clients' reports, "
                "bnpfed.matching.unit_activity on their own data, to leave those out)"]
    dead = sum(int((a == 0).sum()) for report in activity for a in report.values())
    notes = [f"--activity: {dead} unit(s) dead on their client's data left out before matching"]
    for group in activity[0]:
        gone = [j for j, report in enumerate(activity) if not bool((report[group] > 0).any())]
        if len(gone) == len(activity):
            notes.append(f"--activity: warning: group {group!r} is dead at every client (each keeps its first unit "
                         "only, so that the layer is not empty): the global network answers every input alike; "
                         "check the reports, or the clients' training")
        elif gone:
            notes.append(f"--activity: group {group!r} is dead at client(s) {', '.join(map(str, gone))} (each keeps "
                         "its first unit only): their networks answer every input alike there")
    return notes


def _counts(path, J: int, C: int) -> tuple[torch.Tensor | None, str]:
    """The class counts and where they came from: ``"given"``, ``"uniform"`` or ``"estimated"`` (None: estimated
    once the spec is known)."""
    if path is None:
        return None, "estimated"
    if path == "uniform":
        return torch.ones(J, C), "uniform"
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"--counts: expected a JSON file of a J x C table, got {path!r} ({type(error).__name__})") \
            from None
    ok = (isinstance(table, list) and len(table) == J and all(isinstance(r, list) and len(r) == C for r in table)
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                  for r in table for v in r))
    if not ok:
        shape = (f"{len(table)} rows" if isinstance(table, list) else type(table).__name__)
        raise UsageError(f"--counts: expected a {J} x {C} table (one row per MODEL, one count >= 0 per class), got "
                         f"{shape}")
    counts = torch.tensor(table, dtype=torch.float64)
    if (counts.sum(1) <= 0).any():
        raise UsageError(f"--counts: expected every client to hold some examples, got an all-zero row "
                         f"{int(torch.nonzero(counts.sum(1) <= 0)[0])}")
    return counts, "given"


#: The flags of posterior fusion: an error without --posteriors.
POSTERIOR_FLAGS = ("rule", "align", "match_on", "tau2", "pooling_samples", "min_variance")


def prepare(args) -> dict:
    """Everything that can fail on a bad argument or file, before any matching."""
    _args.check_output_path(args.out, "--out")
    _args.check_output_path(args.json, "--json")
    for flag, target in (("--out", args.out), ("--json", args.json)):
        same = [path for path in args.models if target is not None and _same_file(path, target)]
        if same:
            raise UsageError(f"{flag}: expected a path other than the MODEL files, got {target!r}, which is "
                             f"{same[0]!r} (it would be overwritten)")
    if len(args.models) < 2:
        raise UsageError(f"MODEL: expected at least two clients' models, got {len(args.models)}")
    if args.seed < 0:
        raise UsageError(f"--seed: expected an integer >= 0, got {args.seed}")
    args.heads = check_choice(args.heads or "auto", HEADS, "heads")
    if args.posteriors and args.heads == "pooled" and args.align == "none":
        raise UsageError(f"--heads {args.heads}: the clients' own heads on the units theirs were matched to; expected "
                         "--align match with --posteriors (weight-by-weight fusion matches nothing)")
    if args.posteriors:
        for flag in ("max_width", "max_params"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')}: expected only without --posteriors (it limits PFNM's "
                                 f"match of deterministic networks)")
        return prepare_posteriors(args)
    given = [name for name in POSTERIOR_FLAGS if getattr(args, name) is not None]
    if given:
        raise UsageError(f"--{given[0].replace('_', '-')}: expected only with --posteriors (fusing Bayesian "
                         "clients)")
    if args.arch is not None and args.module is not None:
        raise UsageError("--module: expected either --arch or --module (how to rebuild state dicts), got both")
    clients, inputs = zip(*[_read(path) for path in args.models])
    clients = list(clients)
    inputs, input_notes = _common_inputs(args.models, list(inputs))
    kinds = {isinstance(c, nn.Module) for c in clients}
    if len(kinds) > 1:
        raise UsageError("MODEL: expected every file to hold the same kind (all whole networks or all state dicts), "
                         "got both")
    if isinstance(clients[0], nn.Module) and (args.arch or args.module):
        raise UsageError(f"{'--arch' if args.arch else '--module'}: expected only with state-dict files (the files "
                         "hold whole networks)")
    if not isinstance(clients[0], nn.Module) and not (args.arch or args.module):
        raise UsageError("--arch: expected --arch or --module to rebuild the state dicts in the MODEL files")
    for path, client in zip(args.models, clients):
        state = client.state_dict() if isinstance(client, nn.Module) else client
        bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise UsageError(f"MODEL: {path!r} holds NaN or infinite values in {', '.join(bad[:3])}")
    template, input_shape = _template(args, clients[0], args.input_shape)
    from bnpfed.matching import estimate_class_shares

    spec = _checked_spec(template, input_shape, args.spec)
    reference = template.state_dict()
    for path, client in zip(args.models, clients):
        state = client.state_dict() if isinstance(client, nn.Module) else client
        if set(state) != set(reference):
            raise UsageError(f"MODEL: {path!r} is another architecture than {args.models[0]!r}: parameters "
                             f"{sorted(set(state) ^ set(reference))[:4]} differ")
    first = clients[0].state_dict() if isinstance(clients[0], nn.Module) else clients[0]
    _check_alike(args.models, clients, spec, first)
    with torch.no_grad():
        probe = template.eval()(torch.zeros(1, *input_shape))
    counts, source = _counts(args.counts, len(clients), int(probe.shape[-1]))
    heads_note = _auto_heads(args, counts, source)
    if counts is None:
        counts = estimate_class_shares(clients, spec)
    activity = _activity(args.activity, [c.state_dict() if isinstance(c, nn.Module) else c for c in clients], spec)
    pfnm = _options.config_from_args(PFNMConfig, args, PFNMConfig(max_params=None))
    return dict(clients=clients, template=template, input_shape=input_shape, spec=spec, counts=counts,
                counts_source=source, pfnm=pfnm, activity=activity, inputs=inputs, input_notes=input_notes,
                heads_note=heads_note)


def _auto_heads(args, counts, source: str) -> list[str]:
    """``--heads auto`` resolved (``args.heads`` set to ``"fused"`` or ``"pooled"``) and the note that says how:
    pooled when the clients' class counts differ (:func:`~bnpfed.matching.chosen_heads`), fused without counts (the
    estimated shares of the output layers are no counts to test) or without matching (``--align none``). Empty
    when ``--heads`` was given."""
    from bnpfed.matching import SHARES_DIFFER_LEVEL, homogeneity_p_value

    if args.heads != "auto":
        return []
    if counts is None or source == "estimated" or (args.posteriors and args.align == "none"):
        args.heads = "fused"
        why = ("--align none matches nothing" if args.posteriors and args.align == "none" else
               "without --counts the class shares are estimated, not counted, so whether they differ is not tested; "
               "--heads pooled pools the clients' own output layers, the choice under label skew")
        return [f"--heads auto: fused ({why})"]
    p = homogeneity_p_value(counts)
    args.heads = "pooled" if p < SHARES_DIFFER_LEVEL else "fused"
    return [f"--heads auto: {args.heads} (the clients' class counts {'differ' if p < SHARES_DIFFER_LEVEL else 'agree'}"
            f": chi-squared test of homogeneity p = {p:.3g}, against {SHARES_DIFFER_LEVEL:g})"]


def run(args) -> int:
    try:
        plan = prepare(args)
    except UsageError as error:
        return fail(PROG, str(error))
    except ValueError as error:
        return fail(PROG, flag_message(error))
    if args.posteriors:
        return run_posteriors(args, plan)
    from bnpfed.matching import match_by_spec

    spec = plan["spec"]
    if args.show_spec:
        print(spec)
    try:
        match = match_by_spec(plan["clients"], plan["counts"], spec, input_shape=plan["input_shape"],
                              template=plan["template"], seed=args.seed, activity=plan["activity"],
                              **plan["pfnm"].matcher_kwargs())
    except ValueError as error:  # per-group values of the wrong count, and the like: named as flags
        return fail(PROG, flag_message(error))
    if args.heads == "pooled":
        from bnpfed.matching import pooled_network

        try:
            network = pooled_network(match, plan["clients"])
        except ValueError as error:   # an output layer that does not read the last group's units directly
            return fail(PROG, f"--heads pooled: {error}")
    else:
        network = match.network()
    notes = (_counts_notes(plan["counts_source"]) + plan["heads_note"] + _activity_notes(plan["activity"])
             + plan["input_notes"])
    for note in notes:
        if note.startswith("--activity: warning:"):   # said on stderr too, where a script's user sees it
            _args.warn(note)
    if args.heads == "pooled":
        notes.append(f"--heads pooled: the {len(plan['clients'])} clients' own output layers on the matched units, "
                     "log-probabilities pooled with the class shares")
    for group, result in match.layer_results.items():
        notes += [f"{group}: {n}" for n in getattr(result, "notes", [])]
    if "parameters" in match.size_searches:
        notes.append(match.size_searches["parameters"].note())
    notes += _batch_norm_notes(spec)
    save_global(args.out, network, method="pfnm" if args.heads == "fused" else "pfnm-pooled", spec=spec,
                widths=match.widths,
                hyperparameters=match.hyperparameters, class_shares=match.class_shares,
                class_shares_estimated=plan["counts_source"] == "estimated", notes=notes, inputs=plan["inputs"])
    names = dict(plan["template"].named_parameters())  # a state dict's parameters (its buffers are not)
    local = [count_parameters(c) if isinstance(c, nn.Module) else sum(v.numel() for k, v in c.items() if k in names)
             for c in plan["clients"]]
    print(f"matched {len(plan['clients'])} networks ({plan['template'].__class__.__name__}, input "
          f"{tuple(plan['input_shape'])}) in {match.seconds:.2f} s")
    settings = {"pfnm": config_dict(plan["pfnm"]), "clients": len(plan["clients"]),
                "input_shape": list(plan["input_shape"])}
    _report(args, match.widths, match.hyperparameters, count_parameters(network), local, notes, settings)
    return 0


def _batch_norm_notes(spec) -> list[str]:
    """What the result says about batch norms: matched from files, their running statistics are the means of the
    members' (no data was seen), and how to re-estimate them from data the user holds."""
    statistics = spec.params_of_kind("running_mean")
    if not statistics:
        return []
    return [f"{len(statistics)} batch norm(s): each global unit keeps the mean of its members' running statistics "
            "(no data was seen here; a merged unit's activations are not its members' average): re-estimate them "
            "from data you hold: bnpfed.matching.reestimate_batch_norm(bnpfed.load_global(OUT), [batches, ...])"]


def _counts_notes(source: str) -> list[str]:
    return {"given": [], "uniform": ["--counts uniform: every client taken to hold every class equally"],
            "estimated": ["no --counts: each client's class shares estimated from its own output layer "
                          "(bnpfed.matching.class_shares; give --counts when you have them)"]}[source]


def _report(args, widths, hyperparameters, parameters, local, notes, settings) -> None:
    """The table of widths and hyper-parameters per group, the sizes, the notes, and the JSON."""
    rows = [{"group": g, "width": w, **{k: v for k, v in hyperparameters.get(g, {}).items() if k != "mu0"}}
            for g, w in widths.items()]
    print(format_table(rows))
    print(f"global network: {parameters:,} parameters (the {len(local)} local ones: {sum(local):,} together)")
    for note in notes:
        print(f"note: {note}")
    print(f"wrote the global {'posterior' if args.posteriors else 'network'} to {args.out}")
    if args.json:
        write_json(args.json, command_record("match", args, settings, command_results([{
            "rows": rows, "parameters": parameters, "local_parameters": local, "notes": notes, "out": args.out}])))
        print(f"wrote results to {args.json}")


# ------------------------------------------------------------------------------------------------ --posteriors


def _read_bayesian(path: str):
    """One saved Bayesian client's file (:func:`bnpfed.saved.read_global` of a Bayesian file)."""
    from bnpfed.saved import read_global

    try:
        saved = read_global(path)
    except ValueError as error:
        raise UsageError(f"MODEL: {str(error).split(': ', 1)[-1]}") from None
    if saved.client is None:
        raise UsageError(f"MODEL: expected a Bayesian client (saved by bnpfed.save_global(path, client, ...) or "
                         f"bnpfed fuse --save-global) with --posteriors, got a deterministic {saved.method} network in "
                         f"{path!r}")
    return saved


def prepare_posteriors(args) -> dict:
    """``--posteriors``: the saved Bayesian clients read and checked, the flags that do not apply refused."""
    align = check_choice(args.align or "match", ("match", "none"), "align")
    for flag, value in (("--arch", args.arch), ("--module", args.module), ("--sigma2", args.sigma2)):
        if value is not None:
            why = ("the files hold whole Bayesian networks" if flag != "--sigma2" else
                   "the clients' own posterior variances and --tau2 are the noise of posterior matching")
            raise UsageError(f"{flag}: expected only without --posteriors ({why})")
    if align == "none":
        for flag, value in (("--tau2", args.tau2), ("--sigma0-2", args.sigma0_2), ("--gamma0", args.gamma0),
                            ("--match-on", args.match_on), ("--matcher-device", args.matcher_device),
                            ("--sweeps", args.sweeps), ("--show-spec", args.show_spec or None), ("--spec", args.spec)):
            if value is not None:
                raise UsageError(f"{flag}: expected only with --align match (--align none matches nothing)")
        if args.activity is not None:
            raise UsageError("--activity: expected only with --align match (--align none matches nothing, so no unit "
                             "is left out)")
        if args.hyperparameters is not None:
            raise UsageError("--hyperparameters: expected only with --align match (--align none matches nothing)")
    saved = [_read_bayesian(path) for path in args.models]
    clients = [s.client for s in saved]
    inputs, input_notes = _common_inputs(args.models, [s.inputs for s in saved])
    first = clients[0]
    kind = _client_kind(first)
    sites = list(first.posterior())
    means = [c.mean_network() for c in clients]   # each client's posterior-mean network
    for path, client, mean in zip(args.models, clients, means):
        if _client_kind(client) != kind:
            raise UsageError(f"MODEL: {path!r} holds a {_client_kind(client)} client and {args.models[0]!r} a {kind} "
                             f"one; expected clients of one kind (their posteriors mean different things)")
        if type(mean) is not type(means[0]):
            raise UsageError(f"MODEL: {path!r} is another architecture ({type(mean).__name__}) than "
                             f"{args.models[0]!r} ({type(means[0]).__name__})")
        if list(client.posterior()) != sites:
            raise UsageError(f"MODEL: {path!r} has other Bayesian sites than {args.models[0]!r}: "
                             f"{sorted(set(client.posterior()) ^ set(sites))[:4]} differ")
    template = means[0]
    if align == "none":
        shapes = {k: tuple(v.shape) for k, v in template.state_dict().items()}
        for path, mean in zip(args.models, means):
            other = {k: tuple(v.shape) for k, v in mean.state_dict().items()}
            if other != shapes:
                wrong = next(k for k in shapes if other.get(k) != shapes[k])
                raise UsageError(f"MODEL: --align none fuses weight i with weight i, so every client must have the "
                                 f"shapes of {args.models[0]!r}; {path!r} has {wrong} of shape {other.get(wrong)}, "
                                 f"not {shapes[wrong]} (use --align match)")
    input_shape = _input_shape(template, args.input_shape)
    from bnpfed.matching import estimate_class_shares

    spec = _checked_spec(template, input_shape, args.spec)
    _check_alike(args.models, means, spec, template.state_dict())
    with torch.no_grad():
        probe = template(torch.zeros(1, *input_shape))
    counts, source = _counts(args.counts, len(clients), int(probe.shape[-1]))
    heads_note = _auto_heads(args, counts, source)
    if counts is not None and not bool((counts == counts.round()).all()):
        raise UsageError("--counts: expected whole numbers of examples with --posteriors (their row sums are the "
                         "clients' sizes, the weights of their posteriors)")
    if counts is None and align == "match":
        counts = estimate_class_shares(means, spec)
    activity = _activity(args.activity, [m.state_dict() for m in means], spec)
    floor = MIN_VARIANCE if align == "match" else FusionConfig().min_variance
    fusion = _options.config_from_args(FusionConfig, args, FusionConfig(weights="size", min_variance=floor),
                                       align=align)
    check_choice(fusion.rule, available_rules(), "rule")   # a rule of bnpfed.combine (no atom-posterior, pvi)
    if align == "match" and not fusion.min_variance > 0:
        raise UsageError(f"--min-variance: expected a floor > 0 with --align match, got {args.min_variance}")
    pfnm = _options.given(PFNMConfig, args)   # the matcher's settings (those that apply to posteriors)
    return dict(clients=clients, kind=kind, means=means, template=template, input_shape=input_shape, spec=spec,
                counts=counts, counts_source=source, fusion=fusion, activity=activity, inputs=inputs,
                input_notes=input_notes, heads_note=heads_note,
                matching=dict(sigma0_2=pfnm.get("sigma0_2"), gamma0=pfnm.get("gamma0"), sweeps=pfnm.get("sweeps"),
                              hyperparameters=pfnm.get("hyperparameters", "empirical-bayes")))


def _client_kind(client) -> str:
    """``"laplace"`` for a :class:`~bnpfed.clients.LaplaceClient`, ``"variational"`` for a
    :class:`~bnpfed.clients.BayesianClient` (:class:`~bnpfed.federated.config.BayesianConfig`'s ``client``)."""
    return "laplace" if isinstance(client, LaplaceClient) else "variational"


def _variational(first) -> tuple:
    """What a variational global client takes from the first client: its prior (as it was before any round), and its
    likelihood and local reparameterisation as keywords."""
    return first.bnn.prior.initial(), dict(likelihood=first.bnn.likelihood,
                                           local_reparameterization=first.bnn.local_reparameterization)


def run_posteriors(args, plan) -> int:
    """Fuse the saved clients' posteriors (matched or weight by weight) and write the global Bayesian client."""
    from bnpfed.federated import fuse_posteriors
    from bnpfed.clients import BayesianClient
    from bnpfed.matching import network_from_state
    from bnpfed.matching import width
    from bnpfed.matching import match_posteriors

    clients, fusion, spec = plan["clients"], plan["fusion"], plan["spec"]
    first, laplace = clients[0], plan["kind"] == "laplace"
    if args.show_spec:
        print(spec)
    counts, source = plan["counts"], plan["counts_source"]
    if source == "estimated":   # no --counts: the class shares are estimated when matching, the sizes unknown
        sizes = [1] * len(clients)
        notes = (_counts_notes(source) if fusion.align == "match" else []) + [
            "no --counts: every client's posterior weighs the same (give --counts for weights by size)"]
    else:
        sizes, notes = [int(n) for n in counts.sum(1)], _counts_notes(source)
    notes += plan["heads_note"]
    t0 = time.perf_counter()
    if fusion.align == "match":
        try:
            match = match_posteriors(clients, counts, spec, rule=fusion.rule, sizes=sizes,
                                     input_shape=plan["input_shape"], template=plan["template"], tau2=fusion.tau2,
                                     seed=args.seed, **plan["matching"],
                                     num_samples=fusion.pooling_samples, min_variance=fusion.min_variance,
                                     match_on=fusion.matches_on(plan["kind"]), activity=plan["activity"],
                                     device=args.matcher_device)
        except ValueError as error:
            return fail(PROG, flag_message(error))
        if args.heads == "pooled":   # the fused body, every client's own posterior head pooled inside every draw
            from bnpfed.matching import PooledPosterior
            from bnpfed.matching import client_posterior

            try:
                client = PooledPosterior.of_match(match, [client_posterior(c) for c in clients])
            except ValueError as error:   # an output layer that does not read the last group's units directly
                return fail(PROG, f"--heads pooled: {error}")
            notes.append(f"--heads pooled: the {len(clients)} clients' own posterior output layers on the matched "
                         "units, log-probabilities pooled with the class shares inside every weight draw")
        elif laplace:   # the global posterior with the linearised predictive of Laplace clients
            client = LaplaceClient.holding(match.network(), match.posterior(), first.prior)
        else:
            prior, options = _variational(first)
            client = match.client(prior, **options)
        notes += _activity_notes(plan["activity"])
        for group, result in match.layer_results.items():
            notes += [f"{group}: {n}" for n in getattr(result, "notes", [])]
        described = dict(spec=spec, widths=match.widths, hyperparameters=match.hyperparameters,
                         class_shares=match.class_shares,
                         class_shares_estimated=source == "estimated")
    else:
        step = fuse_posteriors([c.posterior() for c in clients], [c.deterministic_state() for c in clients], sizes,
                               fusion, seed=args.seed, round=1)
        if laplace:   # the template carrying the fused means and deterministic values
            network = network_from_state(plan["template"], {**step.deterministic,
                                                            **{k: p.loc for k, p in step.posterior.items()}})
            client = LaplaceClient.holding(network, step.posterior, first.prior)
        else:
            prior, options = _variational(first)
            client = BayesianClient(plan["template"], prior, **options)
            client.load_posterior(step.posterior)
            client.load_deterministic(step.deterministic)
        if step.floored:
            notes.append(f"{step.floored} fused variance(s) raised to --min-variance {fusion.min_variance:g}")
        state = plan["template"].state_dict()
        described = dict(spec=spec, widths={g.name: width(state, g, "MODEL") for g in spec.groups})
    seconds = time.perf_counter() - t0
    how = "matched and fused" if fusion.align == "match" else "fused weight by weight"
    method = ("match-" if fusion.align == "match" else "") + fusion.rule + ("-pooled" if args.heads == "pooled" else "")
    notes += plan["input_notes"]
    save_global(args.out, client, method=method, notes=notes, inputs=plan["inputs"], **described)
    network = client.mean_network()
    print(f"{how} {len(clients)} Bayesian networks ({type(network).__name__}, input {plan['input_shape']}) with "
          f"{fusion.rule} in {seconds:.2f} s")
    settings = {"fusion": config_dict(fusion), "clients": len(clients), "input_shape": list(plan["input_shape"])}
    _report(args, described["widths"], described.get("hyperparameters", {}), count_parameters(network),
            [count_parameters(m) for m in plan["means"]], notes, settings)
    return 0
