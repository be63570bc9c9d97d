"""Permutation specs (issue 10, section 1): derived specs equal hand-written ones, unsupported modules are named,
matching permuted copies of a CNN gives the network back, an MLP's spec is derived from its first layer."""


import pytest
import torch
from torch import nn
from user_networks import ResNet

from bnpfed.matching.permutation import (
    Axis,
    Group,
    PermutationSpec,
    align_to_group,
    batch_norm_moments,
    client_slice,
    derive_spec,
    match_by_spec,
    match_group,
    network_from_state,
    reestimate_batch_norm,
    state_from_atoms,
    unit_vectors,
    verify_spec,
)
from bnpfed.matching.layout import group_layout
from bnpfed.models import LeNet, mlp, simple_cnn, simple_cnn_bn

EXACT = dict(hyperparameters="fixed", sigma2=1e-8, sigma0_2=1.0, gamma0=1.0)


def randomize_(net: nn.Module, seed: int) -> nn.Module:
    """Weights N(0, 1/fan_in) (outputs of order 1, so that 1e-5 is float32 rounding), vectors N(0, 0.5^2), batch norms'
    running means N(0, 1) and variances U(0.5, 1.5): fresh statistics (0 and 1 everywhere) would be the same under any
    permutation and hide a missing axis."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            scale = p[0].numel() ** -0.5 if p.dim() > 1 else 0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return net.eval()


def permuted_copies(net: nn.Module, spec: PermutationSpec, J: int, seed: int) -> list[nn.Module]:
    g = torch.Generator().manual_seed(seed)
    state = net.state_dict()
    copies = []
    for _ in range(J):
        perms = {grp.name: torch.randperm(state[grp.axes[0].param].shape[grp.axes[0].dim], generator=g)
                 for grp in spec.groups}
        copies.append(network_from_state(net, client_slice(spec, state, perms)).eval())
    return copies


def widths(net: nn.Module, spec: PermutationSpec) -> dict[str, int]:
    state = net.state_dict()
    return {g.name: state[g.axes[0].param].shape[g.axes[0].dim] // g.axes[0].block for g in spec.groups}


class Residual(nn.Module):
    """stem, then x + conv2(relu(conv1(x))): the skip makes stem and conv2 share one permutation."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.conv1 = nn.Conv2d(4, 5, 3, padding=1)
        self.conv2 = nn.Conv2d(5, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4, 3)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(x + self.conv2(torch.relu(self.conv1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 2), 1))


RESIDUAL_SPEC = PermutationSpec(
    groups=[Group("stem", [Axis("stem.weight", 0), Axis("stem.bias", 0), Axis("conv2.weight", 0),
                           Axis("conv2.bias", 0), Axis("conv1.weight", 1), Axis("fc.weight", 1, block=4)]),
            Group("conv1", [Axis("conv1.weight", 0), Axis("conv1.bias", 0), Axis("conv2.weight", 1)])],
    kinds={"stem.weight": "weight", "stem.bias": "bias", "conv1.weight": "weight", "conv1.bias": "bias",
           "conv2.weight": "weight", "conv2.bias": "bias", "fc.weight": "output_weight", "fc.bias": "output_bias"},
)


def conv_chain() -> nn.Sequential:
    """Every layer type derive_spec knows: nested Sequential, Conv2d + BatchNorm2d, Tanh, AvgPool2d, adaptive pooling,
    Flatten into Linear in blocks of 4, BatchNorm1d, GELU, Dropout."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(2, 5, 3, padding=1), nn.BatchNorm2d(5), nn.Tanh(), nn.AvgPool2d(2)),
        nn.Conv2d(5, 4, 3), nn.LeakyReLU(0.1), nn.AdaptiveMaxPool2d(2), nn.Flatten(),
        nn.Linear(16, 7), nn.BatchNorm1d(7), nn.GELU(), nn.Dropout(0.5), nn.Linear(7, 3),
    )


def bn_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5), nn.Sigmoid(),
                         nn.Linear(5, 3))


NETWORKS = {
    "simple-cnn": (lambda: simple_cnn(1, 20, 4), (1, 20, 20)),
    "simple-cnn-bn": (lambda: simple_cnn_bn(1, 20, 4), (1, 20, 20)),
    "lenet": (lambda: LeNet(image_size=16, num_classes=4), (1, 16, 16)),
    "lenet-paper": (lambda: LeNet.paper(2, 12, 4), (2, 12, 12)),
    "conv-chain": (conv_chain, (2, 8, 8)),
    "bn-mlp": (bn_mlp, (3, 4)),
    "residual (hand-written spec)": (Residual, (2, 4, 4)),
    "resnet (identity and projection skips, batch norms on both branches)": (
        lambda: ResNet(blocks=2, width=3, classes=4, channels=2), (2, 8, 8)),
}


# --------------------------------------------------------------------------------------------------------------------
# the spec


def hand_written(convs, fcs, flat_block, *, batch_norm=False, conv_bias=True) -> PermutationSpec:
    """The spec of a LeNet-like network: conv1, conv2, flatten, fc1, fc2, fc3 (batch norms bn1, bn2)."""
    names = ["conv1", "conv2", "fc1", "fc2", "fc3"]
    groups, kinds = [], {}
    for i, name in enumerate(names):
        bias = conv_bias or name.startswith("fc")
        kinds[f"{name}.weight"] = "output_weight" if name == "fc3" else "weight"
        if bias:
            kinds[f"{name}.bias"] = "output_bias" if name == "fc3" else "bias"
        if name == "fc3":
            break
        axes = [Axis(f"{name}.weight", 0)] + ([Axis(f"{name}.bias", 0)] if bias else [])
        if batch_norm and name.startswith("conv"):
            bn = f"bn{i + 1}"
            for suffix, kind in (("weight", "bn_weight"), ("bias", "bn_bias"), ("running_mean", "running_mean"),
                                 ("running_var", "running_var")):
                axes.append(Axis(f"{bn}.{suffix}", 0))
                kinds[f"{bn}.{suffix}"] = kind
        axes.append(Axis(f"{names[i + 1]}.weight", 1, flat_block if name == "conv2" else 1))
        groups.append(Group(name, axes))
    order = ["conv1.weight", "conv1.bias", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var",
             "conv2.weight", "conv2.bias", "bn2.weight", "bn2.bias", "bn2.running_mean", "bn2.running_var"]
    order += [f"fc{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")]
    return PermutationSpec(groups, {k: kinds[k] for k in order if k in kinds})


@pytest.mark.parametrize("net, input_shape, expected", [
    (LeNet(), (1, 28, 28), hand_written((6, 16), (120, 84), 25)),
    (LeNet.paper(), (1, 28, 28), hand_written((6, 16), (120, 84), 16)),
    (LeNet(3, 32), (3, 32, 32), hand_written((6, 16), (120, 84), 36)),
    (simple_cnn(), (3, 32, 32), hand_written((6, 16), (120, 84), 25)),
    (simple_cnn_bn(), (3, 32, 32), hand_written((6, 16), (120, 84), 25, batch_norm=True, conv_bias=False)),
    (simple_cnn(1, 28), (1, 28, 28), hand_written((6, 16), (120, 84), 16)),
], ids=["lenet", "lenet-paper", "lenet-cifar", "simple-cnn", "simple-cnn-bn", "simple-cnn-mnist"])
def test_the_derived_spec_equals_the_hand_written_one(net, input_shape, expected):
    spec = derive_spec(net, input_shape)
    assert spec == expected
    assert list(spec.kinds) == list(expected.kinds)  # the order of the coordinates in a unit's vector
    verify_spec(net, spec, input_shape)


def test_the_spec_of_an_mlp_permutes_its_hidden_layers_and_leaves_inputs_and_classes_alone():
    spec = derive_spec(mlp(10, [7, 5], 3), (2, 5))
    assert spec == PermutationSpec(
        [Group("1", [Axis("1.weight", 0), Axis("1.bias", 0), Axis("3.weight", 1)]),
         Group("3", [Axis("3.weight", 0), Axis("3.bias", 0), Axis("5.weight", 1)])],
        {"1.weight": "weight", "1.bias": "bias", "3.weight": "weight", "3.bias": "bias", "5.weight": "output_weight",
         "5.bias": "output_bias"})


def test_a_batch_norm_joins_the_group_of_the_layer_before_it_across_pooling_and_flatten():
    spec = derive_spec(conv_chain(), (2, 8, 8))
    assert spec.group_names == ["0.0", "1", "5"]
    assert [str(a) for a in spec.group("0.0").axes] == [
        "0.0.weight[0]", "0.0.bias[0]", "0.1.weight[0]", "0.1.bias[0]", "0.1.running_mean[0]", "0.1.running_var[0]",
        "1.weight[1]"]
    assert str(spec.group("1").axes[-1]) == "5.weight[1] in blocks of 4"
    assert [a.param for a in spec.group("5").axes] == ["5.weight", "5.bias", "6.weight", "6.bias", "6.running_mean",
                                                       "6.running_var", "9.weight"]
    assert "6.num_batches_tracked" not in spec.kinds


class Functional(nn.Module):
    """A chain written with functional calls, as research code often is: relu, max_pool2d, view(N, -1)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.fc1 = nn.Linear(3 * 3 * 3, 5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x):
        x = nn.functional.max_pool2d(nn.functional.relu(self.conv(x)), 2)
        x = x.view(x.size(0), -1)
        return self.fc2(torch.tanh(self.fc1(x)))


def test_a_chain_written_with_functional_calls_is_derived_too():
    spec = derive_spec(Functional(), (1, 8, 8))
    assert [str(a) for g in spec.groups for a in g.axes] == [
        "conv.weight[0]", "conv.bias[0]", "fc1.weight[1] in blocks of 9", "fc1.weight[0]", "fc1.bias[0]",
        "fc2.weight[1]"]
    verify_spec(randomize_(Functional(), 5), spec, (1, 8, 8))


class TorchFunctional(Functional):
    """The same chain in torch's own names, which are other objects than torch.nn.functional's: torch.max_pool2d,
    torch.relu_, torch.flatten, a sigmoid method, torch.dropout."""

    def forward(self, x):
        x = torch.flatten(torch.max_pool2d(torch.relu_(self.conv(x)), 2), 1)
        return self.fc2(torch.dropout(self.fc1(x).sigmoid(), 0.5, self.training))


def test_torch_s_own_functional_forms_are_derived_as_the_functional_ones():
    assert torch.max_pool2d is not nn.functional.max_pool2d
    spec = derive_spec(TorchFunctional(), (1, 8, 8))
    assert spec == derive_spec(Functional(), (1, 8, 8))
    verify_spec(randomize_(TorchFunctional(), 5), spec, (1, 8, 8))


def test_a_reshape_that_is_not_a_flatten_is_refused():
    class Regroups(Functional):
        def forward(self, x):
            return self.fc2(self.fc1(self.conv(x).reshape(x.shape[0], 27, -1).sum(2)))

    with pytest.raises(ValueError, match=r"net: expected reshapes that flatten to \(N, features\) .*, got method "
                                         r"'reshape' \(graph node 'reshape'\) reshaping"):
        derive_spec(Regroups(), (1, 5, 5))


def test_printing_a_spec_lists_each_permutation_and_the_output_layer():
    assert str(derive_spec(simple_cnn_bn(), (3, 32, 32))) == "\n".join([
        "PermutationSpec: 4 hidden permutations, matched in this order",
        "  conv1: conv1.weight[0], bn1.weight[0], bn1.bias[0], bn1.running_mean[0], bn1.running_var[0], "
        "conv2.weight[1]",
        "  conv2: conv2.weight[0], bn2.weight[0], bn2.bias[0], bn2.running_mean[0], bn2.running_var[0], "
        "fc1.weight[1] in blocks of 25",
        "  fc1: fc1.weight[0], fc1.bias[0], fc2.weight[1]",
        "  fc2: fc2.weight[0], fc2.bias[0], fc3.weight[1]",
        "  output layer (axis 0 = classes): fc3.weight, fc3.bias",
    ])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return x + self.conv(x)


class Concatenates(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 2, 1), nn.Conv2d(3, 2, 1)
        self.fc = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):
        return self.fc(torch.flatten(torch.cat([self.a(x), self.b(x)], 1), 1))


class AddsItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        return self.fc(torch.flatten(x + self.conv(x), 1))


@pytest.mark.parametrize("net, input_shape, message", [
    (nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(12, 2)), (1, 8), r"module '0' \(Conv1d\)"),
    (nn.Sequential(nn.Linear(4, 3), nn.LSTM(3, 3)), (4,), r"module '1' \(LSTM\)"),
    (nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(Block()), nn.Flatten(), nn.Linear(48, 2)), (3, 4, 4),
     r"one tying the input and the output channels of one layer \('1.0.conv.weight': x \+ W x"),
    (Concatenates(), (3, 4, 4), r"expected operations derive_spec understands, got function 'cat'"),
    (AddsItsInput(), (3, 4, 4),
     r"net: expected a residual addition of two permuted tensors, got function 'add' \(graph node 'add'\) adding "
     r"the network's input"),
    (nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(16, 2)), (4, 4, 4),
     r"module '0' \(Conv2d\) with groups=2"),
    (nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2), nn.BatchNorm1d(2)), (4,),
     r"expected no batch norm after the output layer '2' \(not supported\), got 3\.weight"),
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.Linear(2, 2)), (1, 4, 4), r"into module '1' \(Linear\), got one of shape"),
    (nn.Sequential(nn.Linear(4, 3), nn.Unflatten(1, (3, 1))), (4,), r"module '1' \(Unflatten\)"),
], ids=["conv1d", "lstm", "x-plus-wx", "concatenation", "residual-add", "grouped-conv", "bn-after-output",
        "linear-on-4d",
        "unflatten"])
def test_an_unsupported_module_is_named_with_its_type(net, input_shape, message):
    with pytest.raises(ValueError, match=message):
        derive_spec(net, input_shape)


def test_a_spec_is_checked_when_written():
    with pytest.raises(ValueError, match=r"kinds: expected a kind for every parameter a group acts on, got none for "
                                         r"'w', which group 'a' acts on"):
        PermutationSpec([Group("a", [Axis("w", 0)])], {})
    with pytest.raises(ValueError, match=r"groups: expected a group acting on 'b' \(bias\), got none"):
        PermutationSpec([Group("a", [Axis("w", 0)])], {"w": "weight", "b": "bias"})
    with pytest.raises(ValueError, match=r"kinds\['w'\]: expected one of"):
        PermutationSpec([Group("a", [Axis("w", 0)])], {"w": "kernel"})
    with pytest.raises(ValueError, match=r"Axis.block: expected an int >= 1, got 0"):
        Axis("w", 1, block=0)


def test_verify_spec_catches_a_spec_that_misses_an_axis():
    spec = derive_spec(LeNet(image_size=8), (1, 8, 8))
    broken = PermutationSpec([Group(g.name, [a for a in g.axes if a.param != "fc1.weight"]) if g.name == "conv2"
                              else g for g in spec.groups], spec.kinds)
    with pytest.raises(ValueError, match=r"spec: expected symmetries of net .*, got a change of its outputs by"):
        verify_spec(LeNet(image_size=8), broken, (1, 8, 8))


def test_the_derived_spec_of_a_residual_block_is_the_hand_written_one():
    """The skip ties the stem's channels to conv2's: derive_spec finds the two permutations written by hand."""
    derived = derive_spec(Residual(), (2, 4, 4))
    assert derived.group_names == RESIDUAL_SPEC.group_names and derived.kinds == RESIDUAL_SPEC.kinds
    for mine, theirs in zip(derived.groups, RESIDUAL_SPEC.groups):
        assert set(mine.axes) == set(theirs.axes)


@pytest.mark.parametrize("blocks", [1, 3])
def test_a_resnet_s_skips_tie_each_stage_into_one_permutation(blocks):
    """ResNet-20's layout (blocks=3): one permutation per stage (the stem or the projection, every block's second
    convolution and batch norm, the skips) and one per block's inner channels: 3 + 3 * blocks groups, verified."""
    net = ResNet(blocks=blocks, width=4, classes=10, channels=3)
    spec = derive_spec(net, (3, 8, 8))
    assert len(spec.groups) == 3 + 3 * blocks
    stage2 = spec.group("layers.%d.conv2" % blocks)
    assert {a.param for a in stage2.axes} >= {
        f"layers.{blocks}.shortcut.0.weight", f"layers.{blocks}.shortcut.1.weight", f"layers.{blocks}.bn2.running_var",
        f"layers.{2 * blocks - 1}.conv2.weight"}
    verify_spec(randomize_(net, 1), spec, (3, 8, 8))


def test_a_hand_written_residual_spec_is_a_symmetry_of_the_network():
    verify_spec(randomize_(Residual(), 0), RESIDUAL_SPEC, (2, 4, 4))


# --------------------------------------------------------------------------------------------------------------------
# unit vectors


def test_a_conv_channel_with_batch_norm_is_its_kernel_and_affine_parameters_not_its_running_statistics():
    net = randomize_(simple_cnn_bn(1, 20, 4), 1)
    spec = derive_spec(net, (1, 20, 20))
    uv = unit_vectors(net.state_dict(), spec, "conv1")
    assert [(s.param, s.stop - s.start) for s in uv.layout.segments] == [("conv1.weight", 25), ("bn1.weight", 1),
                                                                         ("bn1.bias", 1)]
    expected = torch.cat([net.conv1.weight.reshape(6, 25), net.bn1.weight[:, None], net.bn1.bias[:, None]], 1)
    torch.testing.assert_close(uv.vectors, expected.detach().double())
    assert uv.layout.precisions(torch.ones(3, 4)) is None


def test_the_last_hidden_group_carries_the_output_weights_at_class_share_precision():
    net = randomize_(simple_cnn(1, 20, 4), 2)
    spec = derive_spec(net, (1, 20, 20))
    below = {"fc1": (torch.tensor(list(range(0, 240, 2))), 240)}  # fc1 matched to 240 units, this client on the even
    uv = unit_vectors(net.state_dict(), spec, "fc2", below)
    assert uv.layout.D == 240 + 1 + 4
    torch.testing.assert_close(uv.vectors[:, 0:240:2], net.fc2.weight.detach().double())
    assert float(uv.vectors[:, 1:240:2].abs().max()) == 0.0
    torch.testing.assert_close(uv.vectors[:, -4:], net.fc3.weight.T.detach().double())
    shares = torch.tensor([[0.5, 0.0, 1.0, 0.25], [0.5, 1.0, 0.0, 0.75]])
    p = uv.layout.precisions(shares)
    assert torch.equal(p[:, :241], torch.ones(2, 241, dtype=torch.float64))
    assert torch.equal(p[:, -4:], shares.double())
    assert uv.layout.prior_mean(0.0, 0.1).tolist()[239:242] == [0.0, 0.1, 0.0]


def test_flattened_channels_carry_their_blocks_of_columns_of_the_next_linear():
    net = randomize_(simple_cnn(1, 20, 4), 3)  # conv2's 16 channels of 2x2 pixels feed fc1's 64 columns
    spec = derive_spec(net, (1, 20, 20))
    ids = torch.tensor([5, 0, 9, 1, 2, 3, 4, 6, 7, 8, 10, 11, 12, 13, 14, 15]) + 2
    uv = unit_vectors(net.state_dict(), spec, "fc1", {"conv2": (ids, 18)})
    assert uv.layout.D == 18 * 4 + 1
    w = net.fc1.weight.detach().double()
    torch.testing.assert_close(uv.vectors[:, 4 * 7:4 * 8], w[:, 0:4])  # client channel 0 -> global 7
    torch.testing.assert_close(uv.vectors[:, 4 * 3:4 * 4], w[:, 12:16])  # client channel 3 -> global 3
    assert float(uv.vectors[:, :8].abs().max()) == 0.0  # global channels 0 and 1: nobody here


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("make, shape", [(lambda: LeNet(image_size=12), (1, 12, 12)),
                                         (lambda: simple_cnn_bn(1, 20), (1, 20, 20))], ids=["lenet", "simple-cnn-bn"])
def test_a_global_state_from_atoms_gives_every_group_its_atoms_back(make, shape, dtype):
    """``state_from_atoms`` is the inverse of ``unit_vectors`` with the identity below: every group's atoms, read
    back from the state at the global widths (Flatten blocks and the output layer's columns included), are the atoms
    given, each parameter its own contiguous tensor in the template's dtype (float32) sharing no memory with them."""
    net = make()
    spec = derive_spec(net, shape)
    template = net.state_dict()
    widths = dict(zip(spec.group_names, (7, 11, 13, 9)))
    g = torch.Generator().manual_seed(0)
    shapes = {k: tuple(v.shape) for k, v in template.items()}
    atoms = {name: torch.randn(widths[name], group_layout(spec, shapes, name, widths).D, generator=g, dtype=dtype)
             for name in spec.group_names}
    state = state_from_atoms(spec, template, atoms)
    assert list(state) == list(template)
    for key, t in state.items():
        assert t.dtype == template[key].dtype and t.is_contiguous()
        assert all(t.untyped_storage().data_ptr() != a.untyped_storage().data_ptr() for a in atoms.values())
    for name in spec.group_names:
        below = {h: (torch.arange(widths[h]), widths[h]) for h in spec.group_names[:spec.group_names.index(name)]}
        back = unit_vectors(state, spec, name, below).vectors
        torch.testing.assert_close(back, atoms[name].to(torch.float32).double(), rtol=0, atol=0)
    assert network_from_state(net, state)(torch.zeros(2, *shape)).shape == (2, 10)


def test_unit_vectors_want_the_groups_matched_before():
    net = simple_cnn(1, 20, 4)
    with pytest.raises(ValueError, match=r"below: expected the global ids of group 'conv1' \(matched before group "
                                         r"'conv2', which needs them\), got none"):
        unit_vectors(net.state_dict(), derive_spec(net, (1, 20, 20)), "conv2")
    with pytest.raises(ValueError, match=r"below\['conv1'\]: expected 6 ids"):
        unit_vectors(net.state_dict(), derive_spec(net, (1, 20, 20)), "conv2", {"conv1": (torch.arange(5), 6)})


# --------------------------------------------------------------------------------------------------------------------
# matching permuted copies gives the network back


@pytest.mark.parametrize("name", list(NETWORKS))
@pytest.mark.parametrize("hyperparameters", ["fixed", "empirical-bayes"])
def test_matching_permuted_copies_recovers_the_network_and_every_client_slice(name, hyperparameters):
    make, input_shape = NETWORKS[name]
    net = randomize_(make(), 10)
    spec = RESIDUAL_SPEC if isinstance(net, Residual) else derive_spec(net, input_shape)
    clients = permuted_copies(net, spec, J=3, seed=11)
    assert not all(torch.equal(a, b) for a, b in zip(clients[0].state_dict().values(), net.state_dict().values()))
    counts = torch.tensor([[5, 1, 0, 3], [1, 5, 2, 2], [2, 2, 6, 0]])[:, :net.state_dict()[
        spec.params_of_kind("output_weight")[0]].shape[0]]
    kwargs = EXACT if hyperparameters == "fixed" else dict(mu0=0.0, bias_mu0=0.0)
    result = match_by_spec(clients, counts, spec, input_shape=input_shape, seed=0, **kwargs)
    assert result.widths == widths(net, spec)
    x = torch.randn(5, *input_shape, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        expected = net(x)
        torch.testing.assert_close(result.network().eval()(x), expected, atol=1e-5, rtol=0)
        for j, client in enumerate(clients):
            mine = result.client_network(j).eval()
            torch.testing.assert_close(mine(x), expected, atol=1e-5, rtol=0)
            for key, value in client.state_dict().items():
                torch.testing.assert_close(result.client_slice(j)[key].to(value.dtype), value, atol=1e-5, rtol=0)


def test_a_narrower_client_is_matched_into_the_wider_network():
    net = randomize_(simple_cnn_bn(1, 20, 4), 20)
    spec = derive_spec(net, (1, 20, 20))
    # client 1 holds the network without fc2 units 10..19, the others in reverse order (a unit of a layer below would
    # change the vectors above it: its weights there read 0, a different neuron)
    keep = {g: torch.randperm(n, generator=torch.Generator().manual_seed(21)) for g, n in widths(net, spec).items()}
    keep["fc2"] = torch.cat([torch.arange(10), torch.arange(20, 84)]).flip(0)
    clients = [net, network_from_state(net, client_slice(spec, net.state_dict(), keep)).eval()]
    assert clients[1].fc2.out_features == 74
    result = match_by_spec(clients, None, spec, seed=0, **EXACT)
    assert result.widths == widths(net, spec)
    for name in spec.group_names:
        assert torch.equal(result.assignments[name][1], result.assignments[name][0][keep[name]])
    x = torch.randn(4, 1, 20, 20)
    with torch.no_grad():
        torch.testing.assert_close(result.client_network(1).eval()(x), clients[1](x), atol=1e-5, rtol=0)
        torch.testing.assert_close(result.network().eval()(x), net(x), atol=1e-5, rtol=0)


def test_state_dicts_with_a_template_match_as_the_networks_do():
    net = randomize_(LeNet(image_size=8), 30)
    spec = derive_spec(net, (1, 8, 8))
    clients = permuted_copies(net, spec, J=2, seed=31)
    a = match_by_spec(clients, None, spec, seed=0, **EXACT)
    b = match_by_spec([c.state_dict() for c in clients], None, spec, template=LeNet(image_size=8), seed=0, **EXACT)
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert isinstance(b.network(), LeNet) and b.network().conv1.out_channels == 6


def test_the_next_round_warm_started_from_the_slices_keeps_the_assignment():
    g = torch.Generator().manual_seed(40)
    nets = [randomize_(simple_cnn(1, 20, 4), 40 + j) for j in range(3)]
    fixed = dict(hyperparameters="fixed", sigma2=0.2, sigma0_2=1.0, gamma0=1.0)
    first = match_by_spec(nets, torch.randint(1, 9, (3, 4), generator=g), input_shape=(1, 20, 20), seed=0, **fixed)
    slices = [first.client_network(j) for j in range(3)]
    again = match_by_spec(slices, first.class_shares, first.spec, warm_start=first, sweeps=0, seed=0, **fixed)
    for name in first.spec.group_names:
        assert all(torch.equal(a, b) for a, b in zip(again.assignments[name], first.assignments[name]))
    as_list = match_by_spec(slices, first.class_shares, first.spec, warm_start=list(first.assignments.values()),
                            sweeps=0, seed=0, **fixed)
    assert all(torch.equal(as_list.state[k], again.state[k]) for k in again.state)


# --------------------------------------------------------------------------------------------------------------------
# an MLP's spec is derived from its first layer


@pytest.mark.parametrize("kwargs", [
    dict(hyperparameters="fixed", sigma2=0.5, sigma0_2=1.0, gamma0=2.0),
    dict(),
    dict(mu0=0.0, sigma2=[0.3, None]),
], ids=["fixed", "empirical-bayes", "partly-given"])
def test_an_mlp_is_matched_by_its_derived_spec_as_modules_or_as_state_dicts_with_a_template(kwargs):
    """No spec and no input_shape: an MLP's spec is derived with input_shape (in_features,), its groups the hidden
    Linear layers; its state dicts with the spec and a template of any width give the same match."""
    torch.manual_seed(0)
    nets = [mlp(20, [8 + j, 6 - j], 4) for j in range(3)]
    counts = [[5, 1, 0, 3], [1, 5, 2, 2], [2, 2, 6, 0]]
    spec = derive_spec(nets[0], (20,))
    assert spec.group_names == ["1", "3"]
    modules = match_by_spec(nets, counts, seed=1, **kwargs)
    assert modules.spec == spec
    states = match_by_spec([n.state_dict() for n in nets], counts, spec, template=mlp(20, [3, 3], 4), seed=1,
                           **kwargs)
    assert states.widths == modules.widths and list(states.layer_results) == ["1", "3"]
    for name in spec.group_names:
        assert all(torch.equal(a, b) for a, b in zip(states.assignments[name], modules.assignments[name]))
    assert list(states.state) == list(modules.state)
    assert all(torch.equal(states.state[k], modules.state[k]) for k in modules.state)
    assert states.output_bias_mu0 == modules.output_bias_mu0
    # the template gives the kind of network, not its widths
    assert [m.out_features for m in states.network() if isinstance(m, nn.Linear)] == [*modules.hidden_sizes, 4]
    for j in range(3):
        mine = states.client_network(j)
        assert [m.out_features for m in mine if isinstance(m, nn.Linear)] == [8 + j, 6 - j, 4]
        assert all(torch.equal(v, modules.client_slice(j)[k]) for k, v in mine.state_dict().items())


def test_hyper_parameters_may_be_given_per_group_by_name():
    torch.manual_seed(1)
    nets = [mlp(10, [6, 5], 3) for _ in range(2)]
    fixed = dict(hyperparameters="fixed", sigma0_2=1.0, gamma0=1.0, seed=0)
    by_name = match_by_spec(nets, sigma2={"1": 0.1, "3": 0.4}, **fixed)
    by_order = match_by_spec(nets, sigma2=[0.1, 0.4], **fixed)
    assert by_name.widths == by_order.widths
    assert [r.hyperparameters["sigma2"] for r in by_name.layer_results.values()] == [0.1, 0.4]
    with pytest.raises(ValueError, match=r"sigma2: expected group names among \['1', '3'\], got \['2'\]"):
        match_by_spec(nets, sigma2={"2": 0.1}, **fixed)


# --------------------------------------------------------------------------------------------------------------------
# batch-norm statistics from the clients' data


def test_reestimated_statistics_of_one_client_are_torch_s_cumulative_running_statistics():
    net = randomize_(simple_cnn_bn(1, 20, 4), 50).train()
    x = torch.randn(64, 1, 20, 20, generator=torch.Generator().manual_seed(51))
    reference = network_from_state(net, net.state_dict())
    for m in reference.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative average: one batch gives that batch's mean and unbiased variance
    with torch.no_grad():
        reference.train()(x)
    mine = reestimate_batch_norm(network_from_state(net, net.state_dict()), [[x]])
    for bn in ("bn1", "bn2"):
        for stat in ("running_mean", "running_var"):
            torch.testing.assert_close(mine.get_buffer(f"{bn}.{stat}"), reference.get_buffer(f"{bn}.{stat}"),
                                       atol=1e-5, rtol=1e-4)


def test_reestimated_batch_norms_normalise_the_pooled_data_even_when_the_clients_inputs_differ():
    """REPAIR's reset one layer at a time: two clients whose inputs differ in distribution (covariate shift); after
    the re-estimate every batch norm's eval-mode output has mean 0 and variance 1 per channel over all their
    examples (up to eps and Bessel's factor). Estimated in one pass -- each layer's inputs normalised by every
    batch's own statistics -- the second batch norm's output variances came out 0.47-1.61."""
    torch.manual_seed(7)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 3), nn.BatchNorm2d(5),
                        nn.ReLU(), nn.Flatten(), nn.Linear(5 * 4 * 4, 3))
    g = torch.Generator().manual_seed(8)
    xa = torch.randn(40, 1, 8, 8, generator=g)
    xb = 2.0 + 3.0 * torch.randn(40, 1, 8, 8, generator=g) * torch.linspace(0.2, 2.0, 8)   # shifted and scaled
    reestimate_batch_norm(net, [[xa[:20], xa[20:]], [xb]])
    net.eval()
    outputs = {}
    hooks = [net[i].register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out.detach().double()))
             for i in (1, 4)]
    with torch.no_grad():
        net(torch.cat([xa, xb]))
    for h in hooks:
        h.remove()
    for i in (1, 4):
        z = outputs[i].transpose(0, 1).reshape(outputs[i].shape[1], -1)
        torch.testing.assert_close(z.mean(1), torch.zeros(z.shape[0], dtype=torch.float64), atol=1e-5, rtol=0)
        torch.testing.assert_close(z.var(1), torch.ones(z.shape[0], dtype=torch.float64), atol=2e-3, rtol=0)


def test_moments_add_over_clients_to_the_moments_of_all_their_data():
    net = randomize_(simple_cnn_bn(1, 20, 4), 52)
    x = torch.randn(30, 1, 20, 20, generator=torch.Generator().manual_seed(53))
    both = batch_norm_moments(net, [x[:10], x[10:]])["bn1"]
    parts = batch_norm_moments(net, [x[:10]])["bn1"] + batch_norm_moments(net, [x[10:]])["bn1"]
    assert both.count == parts.count == 30 * 16 * 16
    torch.testing.assert_close(both.sum, parts.sum)
    pre = net.conv1(x).detach().double()
    torch.testing.assert_close(both.sum, pre.sum((0, 2, 3)))
    assert net.bn1.running_mean.abs().sum() > 0 and not net.training  # the network itself is untouched


# --------------------------------------------------------------------------------------------------------------------
# the networks of issue 10


@pytest.mark.parametrize("in_channels, image_size, flat", [(3, 32, 400), (1, 28, 256), (1, 8, 16), (1, 20, 64)])
def test_simple_cnn_adapts_to_channels_and_image_size(in_channels, image_size, flat):
    for make in (simple_cnn, simple_cnn_bn):
        net = make(in_channels, image_size, 7)
        assert net.fc1.in_features == flat
        assert net.eval()(torch.zeros(2, in_channels, image_size, image_size)).shape == (2, 7)
    with pytest.raises(ValueError, match=r"image_size: expected at least 8 pixels for simple_cnn .*got 7"):
        simple_cnn(1, 7)


def test_simple_cnn_is_fedma_s_network_with_62006_parameters():
    net = simple_cnn()
    assert [(n, tuple(p.shape)) for n, p in net.named_parameters()] == [
        ("conv1.weight", (6, 3, 5, 5)), ("conv1.bias", (6,)), ("conv2.weight", (16, 6, 5, 5)), ("conv2.bias", (16,)),
        ("fc1.weight", (120, 400)), ("fc1.bias", (120,)), ("fc2.weight", (84, 120)), ("fc2.bias", (84,)),
        ("fc3.weight", (10, 84)), ("fc3.bias", (10,))]
    assert sum(p.numel() for p in net.parameters()) == 62_006
    bn = simple_cnn_bn()
    assert isinstance(bn.bn1, nn.BatchNorm2d) and bn.conv1.bias is None and bn.bn2.num_features == 16


# --------------------------------------------------------------------------------------------------------------------
# one group at a time (FedMA)


@pytest.mark.parametrize("kwargs", [dict(hyperparameters="fixed", sigma2=0.5, sigma0_2=1.0, gamma0=2.0), dict()],
                         ids=["fixed", "empirical-bayes"])
def test_matching_group_by_group_with_the_assignments_below_is_match_by_spec(kwargs):
    torch.manual_seed(0)
    nets = [simple_cnn_bn(1, 8) for _ in range(3)]
    counts = [[5, 1, 0, 3, 1, 1, 1, 1, 1, 1], [1, 5, 2, 2, 1, 1, 1, 1, 1, 1], [2, 2, 6, 0, 1, 1, 1, 1, 1, 1]]
    whole = match_by_spec(nets, counts, input_shape=(1, 8, 8), seed=4, **kwargs)
    below = {}
    for c, name in enumerate(whole.spec.group_names):
        one = match_group(nets, whole.spec, name, counts, below=below, seed=4 + c, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(one.assignments, whole.assignments[name]))
        for key, value in one.values().items():
            torch.testing.assert_close(value.to(whole.state[key].dtype), whole.state[key], atol=0, rtol=0)
        below[name] = (one.assignments, one.size)
    assert list(one.output_bias) == ["fc3.bias"] and one.output_bias_mu0 == whole.output_bias_mu0


def test_aligned_clients_share_the_matched_group_and_keep_their_outputs():
    torch.manual_seed(0)
    nets = [LeNet(image_size=8).eval() for _ in range(2)]
    spec = derive_spec(nets[0], (1, 8, 8))
    first = match_group(nets, spec, "conv1", hyperparameters="fixed", sigma2=1e-8, sigma0_2=1.0, gamma0=1.0, seed=0)
    assert first.size == 12                                     # nothing merged: both clients' channels side by side
    aligned = [network_from_state(nets[0], align_to_group(n.state_dict(), spec, first, j)).eval()
               for j, n in enumerate(nets)]
    assert torch.equal(aligned[0].conv1.weight, aligned[1].conv1.weight) and aligned[0].conv2.in_channels == 12
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():   # the units a client lacks feed its next layer through zero columns: the same outputs
        for net, a in zip(nets, aligned):
            torch.testing.assert_close(a(x), net(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"below: expected the global ids of group 'conv1' .*, as the clients hold "
                                         r"\[6, 12\] units"):
        match_group([aligned[0], nets[1]], spec, "conv2")
    second = match_group(aligned, spec, "conv2", seed=1)        # the groups below agree: the identity
    assert len(second.assignments) == 2
