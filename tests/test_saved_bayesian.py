"""Bayesian clients in, one global posterior out: save_global / load_global of a BayesianClient, bnpfed match
--posteriors (matched and weight by weight), bnpfed fuse --save-global, bnpfed evaluate of a Bayesian file."""

import json
import re

import pyro.distributions as dist
import pytest
import torch
from torch.testing import assert_close

import bnpfed
from bnpfed.cli import main
from bnpfed.federated.clients import initial_network
from bnpfed.federated.config import FusionConfig, NetworkConfig
from bnpfed.federated.partition import class_counts
from bnpfed.federated.server import fuse_posteriors
from bnpfed.clients import BayesianClient, LaplaceClient
from bnpfed.matching import PooledPosterior, derive_spec, match_by_spec
from bnpfed.matching.class_shares import estimate_class_shares
from bnpfed.matching.posteriors import match_posteriors
from bnpfed.metrics import classification_report
from bnpfed.models import IIDPrior, LeNet, only_linear_weights
from bnpfed.saved import read_global, save_global
from bnpfed.seeding import Stream, derive_seed
from user_networks import UserCNN, UserPlainCNN


def mlp(j):
    return initial_network(NetworkConfig(hidden=(32,)), (1, 8, 8), 10, seed=0, client=j)


#: Each kind of client network, from its own initialisation (j) or the shared one (None).
KINDS = {"mlp": mlp, "lenet": lambda j: LeNet(image_size=8), "user": lambda j: UserPlainCNN()}


def fitted(make, digits, parts, *, shared=False, epochs=4, **kwargs):
    clients = []
    for j, p in enumerate(parts):
        torch.manual_seed(j)
        client = BayesianClient(make(None if shared else j), only_linear_weights(), **kwargs)
        # one rate for all: a few epochs on a few hundred digits are the scales' transient at the default ten-times
        # rate (their sd climbing to the prior's before the means have grown), which these files need not carry
        clients.append(client.fit(digits.x_train[p], digits.y_train[p], epochs=epochs, lr=1e-2, scale_lr=1e-2,
                                  seed=j))
    return clients


@pytest.fixture(scope="module")
def folder(tmp_path_factory, digits, parts):
    """Every kind's three Bayesian clients saved as a user saves them (save_global(path, client, method=...)),
    three MLP clients of one shared initialisation (for weight-wise fusion), and three Laplace MLP clients of their own
    initialisations and three of the shared one."""
    root = tmp_path_factory.mktemp("bayesian")
    for kind, make in KINDS.items():
        for j, client in enumerate(fitted(make, digits, parts)):
            save_global(root / f"{kind}{j}.pt", client, method="client")
    for j, client in enumerate(fitted(mlp, digits, parts, shared=True)):
        save_global(root / f"shared{j}.pt", client, method="client")
    for shared in (False, True):   # Laplace clients: their own initialisations, or one shared one
        for j, p in enumerate(parts):
            client = LaplaceClient(mlp(None if shared else j)).fit(digits.x_train[p], digits.y_train[p], epochs=4,
                                                                   lr=1e-2, seed=j)
            save_global(root / f"laplace{'-shared' if shared else ''}{j}.pt", client, method="client")
    (root / "counts.json").write_text(json.dumps(class_counts(digits.y_train.numpy(), parts, 10).tolist()))
    return root


def files(folder, kind):
    return [str(folder / f"{kind}{j}.pt") for j in range(3)]


def predictive(client, x, seed=0):
    return client.predict_proba(x, num_samples=8, seed=seed)


@pytest.mark.parametrize("kind", ["mlp", "lenet", "user", "user-bn", "mlp-local-reparameterization",
                                  "mlp-posterior-as-prior"])
def test_a_saved_bayesian_client_loads_back_with_the_same_posterior_predictive(kind, tmp_path, digits, parts):
    make = {"user-bn": lambda j: UserCNN()}.get(kind) or KINDS[kind.split("-")[0]]
    kwargs = {"local_reparameterization": True} if kind.endswith("reparameterization") else {}
    (client,) = fitted(make, digits, parts[:1], epochs=2, **kwargs)
    if kind.endswith("prior"):
        client.update_prior_(client.posterior())
    loaded = bnpfed.load_global(save_global(tmp_path / "c.pt", client, method="client"))
    assert isinstance(loaded, BayesianClient)
    assert loaded.bnn.local_reparameterization == client.bnn.local_reparameterization
    x = digits.x_test
    # the same draws from the same posterior (the guide's scale goes through softplus^-1 and back: float rounding)
    assert_close(predictive(loaded, x), predictive(client, x))
    for site, p in client.posterior().items():
        assert torch.equal(loaded.posterior()[site].loc, p.loc)
        assert_close(loaded.posterior()[site].variance, p.variance)
    for site, prior in client.bnn.prior_distributions().items():  # the prior too (the posterior-as-prior, here)
        again = loaded.bnn.prior_distributions()[site]
        assert torch.equal(again.mean, prior.mean) and torch.equal(again.variance, prior.variance), site
    saved = read_global(tmp_path / "c.pt")
    raw = torch.load(tmp_path / "c.pt", weights_only=False)  # torch alone: the posterior-mean network
    with torch.no_grad():
        assert torch.equal(raw["module"].eval()(x), client.mean_network()(x)) and saved.kind == "bayesian"
    assert set(raw["posterior"]) == set(client.posterior())


def test_a_regression_client_keeps_its_likelihood(tmp_path):
    from bnpfed.models import Gaussian
    from bnpfed.models import mlp as plain_mlp

    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    y = x.sum(1)
    client = BayesianClient(plain_mlp(3, [8], 1), only_linear_weights(), likelihood=Gaussian(scale=0.1))
    client.fit(x, y, epochs=3, batch_size=16, lr=1e-2, seed=0)
    again = bnpfed.load_global(save_global(tmp_path / "r.pt", client, method="client"))
    assert isinstance(again.bnn.likelihood, Gaussian) and again.bnn.likelihood.scale == 0.1
    a, b = again.predict(x, num_samples=4, seed=0), client.predict(x, num_samples=4, seed=0)
    assert_close(a.mean, b.mean)
    assert_close(a.variance, b.variance)


def test_the_mean_network_is_the_bayesian_network_at_its_posterior_means(digits, parts):
    (client,) = fitted(mlp, digits, parts[:1], epochs=2)
    means = {site: p.loc for site, p in client.posterior().items()}
    with torch.no_grad():
        assert_close(client.mean_network()(digits.x_test), client.bnn.output_at(digits.x_test, means), rtol=0,
                     atol=0)


def test_predictive_is_recorded_only_for_a_bayesian_network(tmp_path):
    with pytest.raises(ValueError, match="predictive: expected only with a Bayesian network"):
        save_global(tmp_path / "n.pt", mlp(0), method="pfnm", predictive={"samples": 10, "seed": 0})
    client = BayesianClient(mlp(0), only_linear_weights())
    with pytest.raises(ValueError, match="predictive: expected {'samples': S, 'seed': s}"):
        save_global(tmp_path / "c.pt", client, method="c", predictive={"samples": 10})
    assert read_global(save_global(tmp_path / "c.pt", client, method="c")).predictive is None


def test_a_prior_that_cannot_be_pickled_is_named(tmp_path):
    client = BayesianClient(mlp(0), IIDPrior(dist.Normal(0.0, 1.0), expose=[lambda name, module: "weight" in name]))
    with pytest.raises(ValueError, match=r"network: its prior or likelihood cannot be saved"):
        save_global(tmp_path / "c.pt", client, method="client")
    assert not (tmp_path / "c.pt").exists()


# ------------------------------------------------------------------------------------------------ match --posteriors


def loaded(folder, kind):
    return [bnpfed.load_global(f) for f in files(folder, kind)]


@pytest.mark.parametrize("kind, extra", [("mlp", []), ("lenet", ["--input-shape", "1,8,8"]),
                                         ("user", ["--input-shape", "1,8,8"])])
def test_bnpfed_match_posteriors_writes_the_global_posterior_match_posteriors_builds(kind, extra, folder, tmp_path,
                                                                                   digits, capsys):
    out = tmp_path / "g.pt"
    assert main(["match", "--heads", "fused", *files(folder, kind), *extra, "--posteriors", "--rule", "gaa", "--counts",
                 str(folder / "counts.json"), "--out", str(out), "--json", str(tmp_path / "m.json")]) == 0
    assert f"wrote the global posterior to {out}" in capsys.readouterr().out
    clients = loaded(folder, kind)
    counts = torch.tensor(json.loads((folder / "counts.json").read_text()))
    match = match_posteriors(clients, counts, rule="gaa", sizes=[int(n) for n in counts.sum(1)],
                             input_shape=digits.input_shape, template=clients[0].mean_network(), seed=0)
    expected = match.client(only_linear_weights())
    saved = read_global(out)
    assert saved.kind == "bayesian" and saved.method == "match-gaa" and saved.widths == match.widths
    x = digits.x_test
    assert_close(predictive(saved.client, x), predictive(expected, x))
    local = [classification_report(predictive(c, x).double(), digits.y_test)["accuracy"] for c in clients]
    fused = classification_report(predictive(saved.client, x).double(), digits.y_test)["accuracy"]
    assert fused > max(local), (fused, local)  # label-skewed clients: the fused posterior beats each of them
    rows = json.loads((tmp_path / "m.json").read_text())["results"]["runs"][0]["rows"]
    assert [r["width"] for r in rows] == list(match.widths.values())


def test_bnpfed_match_posteriors_without_counts_estimates_the_class_shares(folder, tmp_path, digits, capsys):
    out = tmp_path / "g.pt"
    assert main(["match", *files(folder, "mlp"), "--posteriors", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "class shares estimated" in text and "every client's posterior weighs the same" in text
    clients = loaded(folder, "mlp")
    template = clients[0].mean_network()
    shares = estimate_class_shares([c.mean_network() for c in clients], derive_spec(template, digits.input_shape))
    expected = match_posteriors(clients, shares, rule=FusionConfig().rule, sizes=[1, 1, 1],
                                input_shape=digits.input_shape, template=template, seed=0)
    saved = read_global(out)
    assert saved.class_shares_estimated and saved.method == f"match-{FusionConfig().rule}"
    assert_close(predictive(saved.client, digits.x_test), predictive(expected.client(only_linear_weights()),
                                                                     digits.x_test))


def test_bnpfed_match_posteriors_align_none_is_the_weight_wise_fusion(folder, tmp_path, digits):
    out = tmp_path / "g.pt"
    assert main(["match", *files(folder, "shared"), "--posteriors", "--align", "none", "--rule", "eaa", "--counts",
                 str(folder / "counts.json"), "--out", str(out)]) == 0
    clients = loaded(folder, "shared")
    sizes = [int(n) for n in torch.tensor(json.loads((folder / "counts.json").read_text())).sum(1)]
    step = fuse_posteriors([c.posterior() for c in clients], [c.deterministic_state() for c in clients], sizes,
                           FusionConfig(rule="eaa"), seed=0, round=1)
    saved = read_global(out)
    for site, p in step.posterior.items():
        assert torch.equal(saved.client.posterior()[site].loc, p.loc.to(torch.float32))
        assert_close(saved.client.posterior()[site].variance, p.variance.to(torch.float32))  # via softplus^-1
    assert all(torch.equal(saved.client.deterministic_state()[k], v) for k, v in step.deterministic.items())
    assert saved.method == "eaa" and saved.widths == {"1": 32}


def test_bnpfed_match_posteriors_takes_laplace_clients_matched_on_their_means_by_default(folder, tmp_path, digits,
                                                                                       capsys):
    """Laplace clients saved as a user saves them: matched on the posterior means (PFNM's model, FusionConfig's
    match_on="auto" for Laplace clients) unless --match-on posteriors, fused along that assignment, and written as a
    Laplace client (the linearised predictive); the same as match_posteriors called directly."""
    counts = torch.tensor(json.loads((folder / "counts.json").read_text()))
    sizes = [int(n) for n in counts.sum(1)]
    clients = loaded(folder, "laplace")
    assert all(isinstance(c, LaplaceClient) for c in clients)
    template = clients[0].mean_network()
    x = digits.x_test
    widths = {}
    for match_on in ("means", "posteriors"):
        out = tmp_path / f"{match_on}.pt"
        flag = [] if match_on == "means" else ["--match-on", match_on]
        assert main(["match", "--heads", "fused", *files(folder, "laplace"), "--posteriors", *flag, "--counts",
                     str(folder / "counts.json"), "--out", str(out)]) == 0
        assert "no --activity: every unit matched, dead ones included" in capsys.readouterr().out
        match = match_posteriors(clients, counts, rule=FusionConfig().rule, sizes=sizes,
                                 input_shape=digits.input_shape, template=template, seed=0, match_on=match_on)
        saved = read_global(out)
        assert saved.kind == "laplace" and isinstance(saved.client, LaplaceClient)
        assert saved.widths == match.widths and saved.method == f"match-{FusionConfig().rule}"
        for site, p in match.posterior().items():
            assert_close(saved.client.posterior()[site].loc, p.loc.float())
            assert_close(saved.client.posterior()[site].variance, p.variance.float())
        expected = LaplaceClient.holding(match.network(), match.posterior(), clients[0].prior)
        assert_close(saved.client.predict_proba(x, num_samples=4, seed=1), expected.predict_proba(x, num_samples=4,
                                                                                                  seed=1))
        widths[match_on] = saved.widths["1"]
    # post-hoc posteriors keep most weights near their prior variance: on them the units keep further apart
    assert widths["posteriors"] > widths["means"], widths


def test_bnpfed_match_posteriors_with_activity_reports_leaves_the_dead_units_out(folder, tmp_path, digits, parts,
                                                                              capsys):
    """--activity with Laplace clients: match_posteriors with the same reports (matched on the means, the units dead
    on their client's data left out first)."""
    from bnpfed.matching import unit_activity

    clients = loaded(folder, "laplace")
    means = [c.mean_network() for c in clients]
    spec = derive_spec(means[0], digits.input_shape)
    activity = [unit_activity(m, digits.x_train[p], spec) for m, p in zip(means, parts)]
    (tmp_path / "activity.json").write_text(json.dumps([{g: a.tolist() for g, a in r.items()} for r in activity]))
    out = tmp_path / "g.pt"
    assert main(["match", "--heads", "fused", *files(folder, "laplace"), "--posteriors", "--counts",
                 str(folder / "counts.json"), "--activity", str(tmp_path / "activity.json"), "--out", str(out)]) == 0
    dead = sum(int((a == 0).sum()) for r in activity for a in r.values())
    assert dead > 0 and f"--activity: {dead} unit(s) dead" in capsys.readouterr().out
    counts = torch.tensor(json.loads((folder / "counts.json").read_text()))
    match = match_posteriors(clients, counts, rule=FusionConfig().rule, sizes=[int(n) for n in counts.sum(1)],
                             input_shape=digits.input_shape, template=means[0], seed=0, match_on="means",
                             activity=activity)
    assert sum(k["1"].numel() for k in match.kept_units) == 3 * 32 - dead
    saved = read_global(out)
    assert saved.widths == match.widths
    for site, p in match.posterior().items():
        assert_close(saved.client.posterior()[site].loc, p.loc.float())


def test_bnpfed_match_posteriors_match_on_means_for_variational_clients_is_pfnms_assignment(folder, tmp_path, digits):
    out = tmp_path / "g.pt"
    assert main(["match", "--heads", "fused", *files(folder, "mlp"), "--posteriors", "--match-on", "means", "--counts",
                 str(folder / "counts.json"), "--out", str(out)]) == 0
    clients = loaded(folder, "mlp")
    counts = torch.tensor(json.loads((folder / "counts.json").read_text()))
    match = match_posteriors(clients, counts, rule=FusionConfig().rule, sizes=[int(n) for n in counts.sum(1)],
                             input_shape=digits.input_shape, template=clients[0].mean_network(), seed=0,
                             match_on="means")
    pfnm = match_by_spec([c.mean_network() for c in clients], counts, match.spec, seed=0)
    assert match.widths == pfnm.widths
    assert all(torch.equal(a, b) for a, b in zip(match.assignments["1"], pfnm.assignments["1"]))
    saved = read_global(out)
    assert saved.kind == "bayesian" and saved.widths == match.widths
    assert_close(predictive(saved.client, digits.x_test), predictive(match.client(only_linear_weights()),
                                                                     digits.x_test))


def test_bnpfed_match_posteriors_align_none_fuses_laplace_clients_weight_by_weight(folder, tmp_path, digits):
    out = tmp_path / "g.pt"
    assert main(["match", *files(folder, "laplace-shared"), "--posteriors", "--align", "none", "--rule", "gaa",
                 "--counts", str(folder / "counts.json"), "--out", str(out)]) == 0
    clients = loaded(folder, "laplace-shared")
    sizes = [int(n) for n in torch.tensor(json.loads((folder / "counts.json").read_text())).sum(1)]
    step = fuse_posteriors([c.posterior() for c in clients], [c.deterministic_state() for c in clients], sizes,
                           FusionConfig(rule="gaa"), seed=0, round=1)
    saved = read_global(out)
    assert saved.kind == "laplace"
    for site, p in step.posterior.items():
        assert torch.equal(saved.client.posterior()[site].loc, p.loc.float())
        assert_close(saved.client.posterior()[site].variance, p.variance.float())
        assert torch.equal(dict(saved.network.named_parameters())[site].detach(), p.loc.float())
    assert all(torch.equal(saved.client.deterministic_state()[k], v.float()) for k, v in step.deterministic.items())


@pytest.mark.parametrize("argv, message", [
    (lambda f: [*files(f, "mlp")[:2], files(f, "laplace")[2], "--posteriors"],
     r"MODEL: .*laplace2\.pt' holds a laplace client and .*mlp0\.pt' a variational one; expected clients of one kind"),
    (lambda f: [*files(f, "laplace"), "--posteriors", "--align", "none", "--match-on", "means"],
     r"--match-on: expected only with --align match"),
    (lambda f: [*files(f, "mlp"), "--match-on", "means"], r"--match-on: expected only with --posteriors"),
    (lambda f: [*files(f, "laplace"), "--posteriors", "--align", "none", "--activity", str(f / "counts.json")],
     r"--activity: expected only with --align match"),
    (lambda f: [*files(f, "mlp"), "--posteriors", "--sigma2", "0.1"], r"--sigma2: expected only without --posteriors"),
    (lambda f: [*files(f, "mlp"), "--posteriors", "--arch", "mlp"], r"--arch: expected only without --posteriors"),
    (lambda f: [*files(f, "mlp"), "--rule", "gaa"], r"--rule: expected only with --posteriors"),
    (lambda f: [*files(f, "mlp"), "--align", "none"], r"--align: expected only with --posteriors"),
    (lambda f: [*files(f, "mlp"), "--posteriors", "--align", "none", "--tau2", "0.1"],
     r"--tau2: expected only with --align match"),
    (lambda f: [*files(f, "mlp"), "--posteriors", "--align", "none", "--gamma0", "1"],
     r"--gamma0: expected only with --align match"),
    (lambda f: files(f, "mlp"), r"MODEL: .* holds a Bayesian client; expected --posteriors"),
    (lambda f: [*files(f, "mlp")[:2], files(f, "lenet")[2], "--posteriors"], r"MODEL: .* is another architecture"),
    (lambda f: [*files(f, "lenet"), "--posteriors"], r"--input-shape: expected the shape of one input"),
    (lambda f: [*files(f, "mlp"), "--posteriors", "--counts", str(f / "fractional.json")],
     r"--counts: expected whole numbers"),
    (lambda f: [*files(f, "mlp"), "--posteriors", "--align", "match", "--min-variance", "0"],
     r"--min-variance: expected a floor > 0"),
    (lambda f: [str(f / "nan.pt"), *files(f, "mlp")[1:], "--posteriors"],
     r"MODEL: .*nan\.pt' holds a posterior that does not load \(posterior\['1\.weight'\] loc: expected finite"),
    (lambda f: [str(f / "negative.pt"), *files(f, "mlp")[1:], "--posteriors"],
     r"posterior\['1\.weight'\] variance: expected all entries > 0"),
])
def test_bad_input_to_bnpfed_match_posteriors_is_named_before_any_fusion(argv, message, folder, tmp_path, capsys,
                                                                        monkeypatch):
    from bnpfed.matching import posteriors as posterior_matching

    (folder / "fractional.json").write_text(json.dumps([[0.5] * 10] * 3))
    for name, change in (("nan", lambda p: p["loc"]), ("negative", lambda p: p["variance"])):
        record = torch.load(files(folder, "mlp")[0], weights_only=False)
        change(record["posterior"]["1.weight"])[0, 0] = float("nan") if name == "nan" else -1.0
        torch.save(record, folder / f"{name}.pt")
    called = []
    monkeypatch.setattr(posterior_matching, "match_posteriors", lambda *a, **k: called.append(1))
    assert main(["match", *argv(folder), "--out", str(tmp_path / "g.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bnpfed match: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not called and not (tmp_path / "g.pt").exists()


def test_a_deterministic_file_is_refused_by_match_posteriors(folder, tmp_path, capsys, digits):
    save_global(tmp_path / "net.pt", mlp(0), method="pfnm")
    assert main(["match", str(tmp_path / "net.pt"), *files(folder, "mlp")[1:], "--posteriors", "--out",
                 str(tmp_path / "g.pt")]) == 2
    assert "expected a Bayesian client" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ fuse --save-global


def test_bnpfed_fuse_save_global_writes_every_global_model_its_methods_built(tmp_path, capsys, digits):
    out, folder = tmp_path / "fuse.json", tmp_path / "globals"
    assert main(["fuse", "--clients", "3", "--rounds", "1", "--epochs", "1", "--hidden", "16", "--align", "match",
                 "--rule", "eaa,conflation", "--no-progress", "--json", str(out), "--save-global", str(folder)]) == 0
    methods = ["pfnm", "fedavg", "eaa", "conflation", "match-eaa", "match-conflation"]
    assert f"wrote 6 global models to {folder}: {', '.join(m + '.pt' for m in methods)}" in capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]["runs"][0]["rows"]}
    seed = derive_seed(0, Stream.PREDICT, 1)  # the draws the federation scored its global posterior with (round 1)
    for method in methods:
        saved = read_global(folder / f"{method}.pt")
        assert saved.method == method and saved.kind == ("deterministic" if method in ("pfnm", "fedavg")
                                                         else "bayesian")
        with torch.no_grad():
            probs = (saved.network(digits.x_test).softmax(-1) if saved.client is None else
                     saved.client.predict_proba(digits.x_test, num_samples=10, seed=seed))
        accuracy = float((probs.argmax(-1) == digits.y_test).double().mean())
        assert accuracy == pytest.approx(rows[method]["accuracy"], abs=1e-9), method  # the model the row scored
        assert sum(p.numel() for p in saved.network.parameters()) == rows[method]["parameters"], method
    assert read_global(folder / "match-eaa.pt").widths == {"1": rows["match-eaa"]["width"]}
    # bnpfed evaluate draws what the row was scored with (the file records it): the same accuracy, no flags needed
    assert read_global(folder / "eaa.pt").predictive == {"samples": 10, "seed": seed}
    for method in ("eaa", "match-conflation"):
        assert main(["evaluate", str(folder / f"{method}.pt"), "--dataset", "digits", "--json",
                     str(tmp_path / "e.json")]) == 0
        (row,) = json.loads((tmp_path / "e.json").read_text())["results"]["runs"][0]["rows"]
        assert row["accuracy"] == pytest.approx(rows[method]["accuracy"], abs=1e-12), method
    # on the inputs the clients saw: standardised with the train split's constants, which the file records
    assert all(read_global(folder / f"{m}.pt").inputs == digits.preprocessing() for m in methods)
    assert main(["evaluate", str(folder / "eaa.pt"), "--no-standardize"]) == 2
    assert "--no-standardize: expected it left out" in capsys.readouterr().err


def test_bnpfed_evaluate_scores_a_bayesian_file_by_its_posterior_predictive(folder, tmp_path, digits, capsys):
    path = files(folder, "mlp")[0]
    assert main(["evaluate", path, "--dataset", "digits", "--predictive-samples", "8", "--seed", "3", "--json",
                 str(tmp_path / "e.json")]) == 0
    assert "Bayesian: posterior predictive of 8 weight draws, seed 3" in capsys.readouterr().out
    (row,) = json.loads((tmp_path / "e.json").read_text())["results"]["runs"][0]["rows"]
    probs = bnpfed.load_global(path).predict_proba(digits.x_test, num_samples=8, seed=3).double()
    for key, value in classification_report(probs, digits.y_test, n_bins=15).items():
        assert row[key] == pytest.approx(value, rel=1e-9), key
    save_global(tmp_path / "net.pt", mlp(0), method="pfnm")
    assert main(["evaluate", str(tmp_path / "net.pt"), "--dataset", "digits", "--seed", "1"]) == 2
    assert "--seed: expected only with a Bayesian global network" in capsys.readouterr().err


def test_a_prediction_runs_in_eval_mode_and_changes_no_running_statistic(digits, parts):
    (client,) = fitted(lambda j: UserCNN(), digits, parts[:1], epochs=1)
    before = {k: v.clone() for k, v in client.bnn.net.named_buffers()}
    first = predictive(client, digits.x_test[:5])
    assert all(torch.equal(v, before[k]) for k, v in client.bnn.net.named_buffers())  # running statistics kept
    assert client.bnn.training  # the mode is restored
    alone = predictive(client, digits.x_test[:1])  # in eval mode an input's prediction needs no batch around it
    assert_close(alone[0], first[0])


@pytest.mark.parametrize("kind, extra", [("mlp", []), ("lenet", ["--input-shape", "1,8,8"])])
def test_bnpfed_match_posteriors_heads_pooled_writes_the_pooled_posterior_of_the_match(kind, extra, folder, tmp_path,
                                                                                      digits, capsys):
    """A matched posterior with the clients' own posterior heads pooled (a PooledPosterior) is written as kind
    "pooled-posterior" and loads back with the same predictive as ``PooledPosterior.of_match`` of the same match;
    the file's module is its pooled posterior-mean network."""
    from bnpfed.matching.posteriors import client_posterior

    out = tmp_path / "pooled.pt"
    assert main(["match", *files(folder, kind), *extra, "--posteriors", "--heads", "pooled", "--counts",
                 str(folder / "counts.json"), "--out", str(out)]) == 0
    assert "--heads pooled: the 3 clients' own posterior output layers" in capsys.readouterr().out
    clients = loaded(folder, kind)
    counts = torch.tensor(json.loads((folder / "counts.json").read_text()))
    match = match_posteriors(clients, counts, rule=FusionConfig().rule, sizes=[int(n) for n in counts.sum(1)],
                             input_shape=digits.input_shape, template=clients[0].mean_network(), seed=0)
    expected = PooledPosterior.of_match(match, [client_posterior(c) for c in clients])
    saved = read_global(out)
    assert saved.kind == "pooled-posterior" and saved.method == f"match-{FusionConfig().rule}-pooled"
    assert isinstance(saved.client, PooledPosterior) and bnpfed.load_global(out) is not None
    x = digits.x_test
    assert_close(predictive(saved.client, x), predictive(expected, x))
    with torch.no_grad():
        assert_close(saved.network(x), expected.mean_network().to(x.dtype)(x))
    # bnpfed evaluate reads it as any Bayesian file: the predictive of the draws asked for
    assert main(["evaluate", str(out), "--dataset", "digits", "--predictive-samples", "8", "--seed", "0",
                 "--json", str(tmp_path / "e.json")]) == 0
    (row,) = json.loads((tmp_path / "e.json").read_text())["results"]["runs"][0]["rows"]
    probs = expected.predict_proba(x, num_samples=8, seed=0).double()
    assert row["accuracy"] == pytest.approx(classification_report(probs, digits.y_test)["accuracy"], abs=1e-12)
    assert main(["match", *files(folder, kind), *extra, "--posteriors", "--align", "none", "--heads", "pooled",
                 "--out", str(tmp_path / "x.pt")]) == 2
    assert "--heads pooled: the clients' own heads on the units theirs were matched to; expected --align match" in \
        capsys.readouterr().err


def test_a_pooled_posterior_round_trips_through_save_global_with_its_temperature(folder, digits, tmp_path):
    from bnpfed.matching.posteriors import client_posterior

    clients = loaded(folder, "mlp")
    match = match_posteriors(clients, torch.ones(3, 10), input_shape=digits.input_shape,
                             template=clients[0].mean_network(), seed=0)
    pooled = PooledPosterior.of_match(match, [client_posterior(c) for c in clients])
    pooled.temperature = 0.7
    path = save_global(tmp_path / "p.pt", pooled, method="match-conflation-pooled", predictive={"samples": 5,
                                                                                                "seed": 3})
    saved = read_global(path)
    assert saved.client.temperature == 0.7 and saved.predictive == {"samples": 5, "seed": 3}
    for name in ("weight", "weight_variance", "bias", "bias_variance", "pool_weights"):
        assert torch.equal(getattr(saved.client, name), getattr(pooled, name)), name
    assert_close(saved.client.predict_proba(digits.x_test, 5, 3), pooled.predict_proba(digits.x_test, 5, 3),
                 rtol=0, atol=0)
    pooled.weight_variance[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="network: the pooled posterior's 'weight_variance' holds NaN"):
        save_global(tmp_path / "bad.pt", pooled, method="m")


def test_bnpfed_fuse_heads_both_saves_the_pooled_posterior_the_row_scored(tmp_path, digits, capsys):
    out, folder = tmp_path / "fuse.json", tmp_path / "globals"
    assert main(["fuse", "--clients", "3", "--partition", "dirichlet", "--rounds", "1", "--epochs", "1", "--hidden",
                 "16", "--align", "match", "--rule", "conflation", "--heads", "both", "--no-progress", "--json",
                 str(out), "--save-global", str(folder)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]["runs"][0]["rows"]}
    saved = read_global(folder / "match-conflation-pooled.pt")
    assert saved.kind == "pooled-posterior" and isinstance(saved.client, PooledPosterior)
    assert read_global(folder / "match-conflation.pt").kind == "bayesian"
    seed = derive_seed(0, Stream.PREDICT, 1)
    assert saved.predictive == {"samples": 10, "seed": seed}
    probs = saved.client.predict_proba(digits.x_test, num_samples=10, seed=seed)
    accuracy = float((probs.argmax(-1) == digits.y_test).double().mean())
    assert accuracy == pytest.approx(rows["match-conflation-pooled"]["accuracy"], abs=1e-9)
    assert sum(p.numel() for p in saved.network.parameters()) == rows["match-conflation-pooled"]["parameters"]
