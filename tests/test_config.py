"""The configuration shape: one small frozen dataclass per concern, each checking every field by name."""

import math
from dataclasses import replace

import numpy as np
import pytest

from bnpfed.federated.config import (ARCHITECTURES, CNN_LR, FUSION_TRAINING, PAPER_MIN_VARIANCE, PFNM_TRAINING,
                                     BayesianConfig, FusionConfig, LocalSchedule, NetworkConfig, PartitionConfig,
                                     PFNMConfig, TrainingConfig, config_dict, holdout_split, training_for)
from bnpfed.federated.methods import ExperimentConfig
from bnpfed.models import IIDPrior, Prior

BAD = [
    (PartitionConfig, dict(clients=0), "clients: expected an int >= 1, got 0"),
    (PartitionConfig, dict(partition="random"), "partition: expected one of"),
    (PartitionConfig, dict(alpha=0.0), "alpha: expected a positive finite number, got 0.0"),
    (PartitionConfig, dict(alpha=math.nan), "alpha: expected a positive finite number"),
    (PartitionConfig, dict(min_size=-1), "min_size: expected an int >= 0"),
    (NetworkConfig, dict(arch="resnet"), "arch: expected one of"),
    (NetworkConfig, dict(hidden=()), "hidden: expected at least one int >= 1"),
    (NetworkConfig, dict(hidden=(10, 0)), r"hidden\[1\]: expected an int >= 1, got 0"),
    (NetworkConfig, dict(init="xavier"), "init: expected one of"),
    (NetworkConfig, dict(shared_init="yes"), "shared_init: expected a bool"),
    (NetworkConfig, dict(arch="lenet", hidden=(50,)), r"hidden: expected only with arch='mlp' \(the widths of lenet "
                                                       r"are fixed\), got 50 with arch='lenet'"),
    (TrainingConfig, dict(epochs=0), "epochs: expected an int >= 1, got 0"),
    (TrainingConfig, dict(batch_size=0), "batch_size: expected an int >= 1"),
    (TrainingConfig, dict(lr=0.0), "lr: expected a positive finite number"),
    (TrainingConfig, dict(lr=math.inf), "lr: expected a positive finite number"),
    (TrainingConfig, dict(weight_decay=-1e-6), "weight_decay: expected a finite number >= 0.0"),
    (TrainingConfig, dict(round_epochs=0), "round_epochs: expected an int >= 1, got 0"),
    (TrainingConfig, dict(lr_decay=-1.0), r"lr_decay: expected a number in \(0, 1\], got -1.0"),
    (TrainingConfig, dict(lr_decay=1.5), r"lr_decay: expected a number in \(0, 1\]"),
    (BayesianConfig, dict(prior="conv"), "prior: expected one of"),
    (BayesianConfig, dict(prior_scale=0.0), "prior_scale: expected a positive"),
    (BayesianConfig, dict(init_scale=-1.0), "init_scale: expected a positive"),
    (PFNMConfig, dict(sigma2=0.0), "sigma2: expected a positive finite number, got 0.0"),
    (PFNMConfig, dict(sigma2=-1.0), "sigma2: expected a positive finite number"),
    (PFNMConfig, dict(sigma2=math.nan), "sigma2: expected a positive finite number"),
    (PFNMConfig, dict(sigma2=math.inf), "sigma2: expected a positive finite number"),
    (PFNMConfig, dict(sigma2=(1.0, 0.0)), r"sigma2\[1\]: expected a positive"),
    (PFNMConfig, dict(gamma0=0.0), "gamma0: expected a positive finite number"),
    (PFNMConfig, dict(sigma0_2=-2.0), "sigma0_2: expected a positive finite number"),
    (PFNMConfig, dict(constants="mine"), "constants: expected one of"),
    (PFNMConfig, dict(objective="ml"), "objective: expected one of"),
    (PFNMConfig, dict(direction="sideways"), "direction: expected one of"),
    (PFNMConfig, dict(sweeps=-1), "sweeps: expected an int >= 0"),
    (PFNMConfig, dict(fraction=0.0), r"fraction: expected a number in \(0, 1\]"),
    (FusionConfig, dict(rule="median"), "rule: expected one of"),
    (FusionConfig, dict(weights="count"), "weights: expected one of"),
    (FusionConfig, dict(pooling_samples=1), "pooling_samples: expected an int >= 2"),
    (FusionConfig, dict(min_variance=-1.0), "min_variance: expected a finite number >= 0.0"),
    (FusionConfig, dict(fraction=1.5), r"fraction: expected a number in \(0, 1\]"),
    (ExperimentConfig, dict(methods=("foo",)), "methods: expected one of"),
    (ExperimentConfig, dict(methods="pfnm"), "methods: expected a non-empty sequence"),
    (ExperimentConfig, dict(methods=("pfnm", "pfnm")), "methods: expected each method at most once"),
    (ExperimentConfig, dict(rounds=0), "rounds: expected an int >= 1, got 0"),
    (ExperimentConfig, dict(seed=-1), "seed: expected an int >= 0, got -1"),
    (ExperimentConfig, dict(select="test"), "select: expected one of"),
    (ExperimentConfig, dict(holdout=1.5), r"holdout: expected a number in \(0, 1\), got 1.5"),
    (ExperimentConfig, dict(grid_sigma2=(0.1, -1.0)), r"grid_sigma2\[1\]: expected a positive"),
    (ExperimentConfig, dict(ece_bins=0), "ece_bins: expected an int >= 1"),
]


@pytest.mark.parametrize("cls, kwargs, message", BAD, ids=[f"{c.__name__}-{next(iter(k))}" for c, k, _ in BAD])
def test_every_field_is_checked_by_name(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        PFNMConfig().sigma2 = 2.0


def test_one_vocabulary_with_the_old_spellings_accepted():
    assert PartitionConfig(partition="homogeneous").partition == "iid"
    assert PartitionConfig(partition="homo").partition == "iid"
    assert PartitionConfig(partition="hetero").partition == "dirichlet"
    assert NetworkConfig(hidden=[50, 20]).hidden == (50, 20)


def test_the_reference_schedule_retrains_five_epochs_with_a_decayed_rate():
    assert PFNM_TRAINING.schedule(1) == LocalSchedule(10, 0.01)
    epochs, lr = PFNM_TRAINING.schedule(4)
    assert epochs == 5 and lr == pytest.approx(0.01 * 0.99 ** 3)
    assert TrainingConfig(epochs=3).schedule(7) == LocalSchedule(3, 1e-2)


@pytest.mark.parametrize("base", [PFNM_TRAINING, FUSION_TRAINING, TrainingConfig(epochs=3, lr=0.5, batch_size=7)],
                         ids=["pfnm", "fusion", "custom"])
def test_the_convolutional_networks_train_at_the_cnn_rate_and_the_mlp_at_its_schedules_own(base):
    assert training_for("mlp", base) is base
    for arch in ARCHITECTURES:
        if arch == "mlp":
            continue
        cnn = training_for(arch, base)
        assert cnn.lr == CNN_LR == 1e-3
        assert replace(cnn, lr=base.lr) == base   # nothing but the rate changes
    with pytest.raises(ValueError, match="arch: expected one of .*got 'resnet'"):
        training_for("resnet", base)


def test_a_partition_is_drawn_from_the_seed_and_checked_against_the_data_before_anything_trains():
    labels = np.arange(200) % 10
    a, b = (PartitionConfig(clients=4).split(labels, seed=3) for _ in range(2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert sorted(np.concatenate(a).tolist()) == list(range(200))
    c = PartitionConfig(clients=4).split(labels, seed=4)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    with pytest.raises(ValueError, match="min_size: expected at most 50"):
        PartitionConfig(clients=4, partition="dirichlet", min_size=100_000).split(labels, seed=0)
    with pytest.raises(ValueError, match="clients: expected at most the 200 training examples, got 500"):
        PartitionConfig(clients=500).check_fits(200)


def test_holdout_splits_are_disjoint_and_per_client_seeded():
    parts = PartitionConfig(clients=3).split(np.arange(90) % 3, seed=0)
    train, held = holdout_split(parts, 0.2, seed=0)
    for p, t, h in zip(parts, train, held):
        assert len(h) == int(np.ceil(0.2 * len(p))) and not set(t) & set(h)
        assert sorted([*t, *h]) == sorted(p)


def test_a_prior_is_a_name_or_any_prior_object():
    named = BayesianConfig(prior="all", prior_scale=0.5).build_prior()
    assert isinstance(named, IIDPrior)
    mine = IIDPrior()
    assert BayesianConfig(prior=mine).build_prior() is mine
    assert config_dict(BayesianConfig(prior=mine))["prior"] == repr(mine)
    assert isinstance(BayesianConfig().build_prior(), Prior)


def test_the_paper_variance_floor_is_the_published_clamp_of_log_variance():
    assert math.log(PAPER_MIN_VARIANCE) == pytest.approx(-8.0)
    assert FusionConfig().min_variance > 0


def test_pfnm_config_gives_the_matcher_its_keywords():
    kw = PFNMConfig(sigma2=(0.3, 0.5), constants="reference").matcher_kwargs()
    assert kw["sigma2"] == (0.3, 0.5) and kw["popularity_factor"] == 1.0 and kw["max_atoms"] == 700


# --- the training device ---------------------------------------------------------------------------------------------

def test_training_device_is_checked_before_any_work(monkeypatch):
    """cpu is the default; a device that is not a torch device, or CUDA where torch sees none, is refused by name."""
    import torch
    from bnpfed.federated.config import TrainingConfig
    assert TrainingConfig().device == "cpu"
    for bad in ("tpu", "gpu", 0, "cpu:3"):
        with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda"):
            TrainingConfig(device=bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        TrainingConfig(device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert TrainingConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="index below 2"):
        TrainingConfig(device="cuda:2")


def test_bayesian_clients_refuse_another_device(monkeypatch):
    """SVI runs on the CPU only: a CUDA training device is an error before the client trains."""
    import torch
    from bnpfed.federated.clients import bayesian_client, fit_bayesian, initial_network
    from bnpfed.federated.config import BayesianConfig, NetworkConfig, TrainingConfig
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    training = TrainingConfig(device="cuda")
    client = bayesian_client(initial_network(NetworkConfig(hidden=(4,)), (1, 2, 2), 3, seed=0), BayesianConfig())
    before = {k: v.clone() for k, v in client.guide.state_dict().items()}
    with pytest.raises(ValueError, match="training.device: expected 'cpu' for the Bayesian clients"):
        fit_bayesian(client, torch.randn(6, 1, 2, 2), torch.arange(6) % 3, training, seed=0, round=1, index=0)
    assert all(torch.equal(before[k], v) for k, v in client.guide.state_dict().items())


def test_cpu_device_trains_the_same_network():
    """device='cpu' (given) is the default's training exactly."""
    import torch
    from bnpfed.federated.clients import initial_network, train_network
    from bnpfed.federated.config import NetworkConfig, TrainingConfig
    net = initial_network(NetworkConfig(hidden=(5,)), (1, 3, 3), 3, seed=0)
    x, y = torch.randn(20, 1, 3, 3), torch.arange(20) % 3
    a = train_network(net, x, y, TrainingConfig(epochs=2), seed=0, round=1, client=0)
    b = train_network(net, x, y, TrainingConfig(epochs=2, device="cpu"), seed=0, round=1, client=0)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_training_comes_back_to_the_cpu_close_to_it():
    """On a CUDA device the same mini-batches are drawn: the trained network is on the CPU, near the CPU's."""
    import torch
    from bnpfed.federated.clients import initial_network, train_network
    from bnpfed.federated.config import NetworkConfig, TrainingConfig
    net = initial_network(NetworkConfig(hidden=(5,)), (1, 3, 3), 3, seed=0)
    x, y = torch.randn(20, 1, 3, 3), torch.arange(20) % 3
    cpu = train_network(net, x, y, TrainingConfig(epochs=2), seed=0, round=1, client=0)
    gpu = train_network(net, x, y, TrainingConfig(epochs=2, device="cuda"), seed=0, round=1, client=0)
    for k, v in gpu.state_dict().items():
        assert v.device.type == "cpu"
        torch.testing.assert_close(v, cpu.state_dict()[k], rtol=1e-4, atol=1e-5)


def test_values_per_matched_group_are_checked_against_the_networks_groups_before_anything_trains():
    groups = ["1", "3"]   # an MLP of two hidden layers
    PFNMConfig(sigma2=(0.1, 0.2), max_width=(8, None)).check_groups(groups)
    with pytest.raises(ValueError, match=r"sigma0_2: expected one value or one per matched group \(2: 1, 3\), got 3"):
        PFNMConfig(sigma0_2=(1.0, 1.0, 1.0)).check_groups(groups)
    FusionConfig(align="match", tau2=(0.1, 0.2)).check_groups(groups)
    with pytest.raises(ValueError, match=r"tau2: expected one value or one per matched group \(2: 1, 3\), got 1"):
        FusionConfig(align="match", tau2=(0.1,)).check_groups(groups)
