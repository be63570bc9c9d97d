import pytest
import torch
from torch import nn

from bnpfed.models.networks import LeNet, mlp


def fc_weights(net: LeNet) -> int:
    return sum(net.get_parameter(f"fc{i}.weight").numel() for i in (1, 2, 3))


def test_default_lenet_pads_conv1_and_holds_58920_fc_weights_on_28x28():
    net = LeNet()
    assert net.conv1.padding == (2, 2) and net.fc1.in_features == 16 * 5 * 5
    assert fc_weights(net) == 400 * 120 + 120 * 84 + 84 * 10 == 58_920
    assert sum(p.numel() for p in net.parameters()) == 61_706


def test_paper_lenet_has_no_conv1_padding_and_holds_41640_fc_weights_on_28x28():
    net = LeNet.paper()
    assert net.conv1.padding == (0, 0) and net.conv2.padding == (0, 0) and net.fc1.in_features == 16 * 4 * 4
    assert fc_weights(net) == 256 * 120 + 120 * 84 + 84 * 10 == 41_640
    assert sum(p.numel() for p in net.parameters()) == 44_426


def test_paper_lenet_is_lenet_with_conv1_padding_0():
    paper, explicit = LeNet.paper(3, 32, 7), LeNet(3, 32, 7, conv1_padding=0)
    assert type(paper) is LeNet
    assert [(n, p.shape) for n, p in paper.named_parameters()] == [(n, p.shape) for n, p in explicit.named_parameters()]


@pytest.mark.parametrize("make, image_size, flat", [
    (LeNet, 28, 400), (LeNet, 8, 64), (LeNet.paper, 28, 256), (LeNet.paper, 8, 16),
])
def test_both_lenets_run_on_mnist_and_digits_sizes(make, image_size, flat):
    net = make(image_size=image_size, num_classes=10)
    assert net.fc1.in_features == flat
    assert net(torch.zeros(3, 1, image_size, image_size)).shape == (3, 10)


@pytest.mark.parametrize("conv1_padding, smallest", [(2, 4), (0, 8), (1, 6)])
def test_every_image_size_from_the_smallest_up_runs(conv1_padding, smallest):
    for image_size in range(smallest, 33):
        net = LeNet(image_size=image_size, conv1_padding=conv1_padding)
        assert net(torch.zeros(2, 1, image_size, image_size)).shape == (2, 10), image_size


@pytest.mark.parametrize("make, image_size, smallest", [
    (LeNet.paper, 7, 8), (LeNet.paper, 4, 8), (LeNet, 3, 4), (lambda **kw: LeNet(conv1_padding=1, **kw), 5, 6),
])
def test_too_small_images_are_refused_naming_image_size(make, image_size, smallest):
    with pytest.raises(ValueError, match=rf"^image_size: expected at least {smallest} pixels .*got {image_size}$"):
        make(image_size=image_size)


@pytest.mark.parametrize("kwargs, message", [
    (dict(conv1_padding=-1), r"conv1_padding: expected an int >= 0, got -1"),
    (dict(conv1_padding=2.0), r"conv1_padding: expected an int >= 0, got 2.0"),
    (dict(in_channels=0), r"in_channels: expected an int >= 1, got 0"),
    (dict(num_classes=True), r"num_classes: expected an int >= 1, got True"),
    (dict(image_size="28"), r"image_size: expected an int >= 1, got '28'"),
])
def test_lenet_rejects_bad_arguments_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LeNet(**kwargs)


def test_mlp_hidden_widths_are_checked_by_position():
    with pytest.raises(ValueError, match=r"hidden\[1\]: expected an int >= 1, got 0"):
        mlp(4, (3, 0), 2)
    assert [type(m) for m in mlp(4, (), 2)] == [nn.Flatten, nn.Linear]
