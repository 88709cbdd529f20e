"""flatbnn.SWAGModel (issue 44): SWAG in torch.optim.swa_utils.AveragedModel's idiom, beside attach(); and the one
clear error of SWAG.predict on a BatchNorm net without training batches."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import update_bn

from flatbnn import SWAG, SWAGModel, attach


def _bn_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _loader(n_batches=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n_batches)]


def _train_and_collect(model, collect, steps=6):
    """SGD on the model; after each step ``collect()`` (the same weights reach both SWAG paths)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    for x, y in _loader(steps, seed=3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        collect()
    return opt


def test_update_parameters_gives_the_attach_paths_moments_and_this_copy_holds_the_mean():
    model = _bn_net()
    swag_model = SWAGModel(model, max_rank=4)
    attached = attach(SWAG(max_rank=4), copy.deepcopy(model), None)
    twin = attached.module
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    twin.train()
    data = iter(_loader(6, seed=3))

    def both():  # the twin takes the same SGD step, then collects through attach's path
        x, y = next(data)
        opt_twin.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        opt_twin.step()
        attached.collect()
        swag_model.update_parameters(model)
    _train_and_collect(model, both)
    s = swag_model.swag
    assert s.n_collected == attached.n_collected == 6
    assert torch.equal(s.mean, attached.mean) and torch.equal(s.sq_mean, attached.sq_mean)
    assert torch.equal(s.deviations, attached.deviations) and s.deviations.shape[0] == 4
    for p, m in zip(swag_model.module.parameters(), s.mean.split([p.numel() for p in model.parameters()])):
        assert torch.equal(p.detach().reshape(-1), m)
    assert not all(torch.equal(p, q) for p, q in zip(swag_model.module.parameters(), model.parameters()))


def test_moments_and_sample_have_the_known_values():
    model = nn.Linear(2, 1)  # 3 weights: w (1x2) and b
    swag_model = SWAGModel(model, max_rank=3)
    snapshots = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, -1.0]), torch.tensor([2.0, 5.0, 1.0])]
    for w in snapshots:
        with torch.no_grad():
            model.weight.copy_(w[:2].view(1, 2))
            model.bias.copy_(w[2:])
        swag_model.update_parameters(model)
    s = swag_model.swag
    torch.testing.assert_close(s.mean, torch.tensor([2.0, 3.0, 1.0]))
    torch.testing.assert_close(s.sq_mean, torch.tensor([14 / 3, 11.0, 11 / 3]))
    # deviations from the running mean after each snapshot: means (1,2,3), (2,2,1), (2,3,1)
    torch.testing.assert_close(s.deviations, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, -2.0], [0.0, 2.0, 0.0]]))
    torch.testing.assert_close(model(torch.ones(1, 2)), torch.tensor([[8.0]]))  # the last snapshot: 2 + 5 + 1
    torch.testing.assert_close(swag_model(torch.ones(1, 2)), torch.tensor([[6.0]]))  # the mean: 2 + 3 + 1

    swag_model.sample(scale=0.0)
    torch.testing.assert_close(torch.cat([swag_model.module.weight.reshape(-1), swag_model.module.bias]), s.mean)
    swag_model.sample(generator=torch.Generator().manual_seed(5))  # mode swag: scale 0.5, K = 3 columns
    g = torch.Generator().manual_seed(5)
    z1, z2 = torch.randn(3, generator=g), torch.randn(3, generator=g)
    var = torch.tensor([14 / 3 - 4, 11.0 - 9, 11 / 3 - 1])
    dev = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, -2.0], [0.0, 2.0, 0.0]])
    expected = s.mean + 0.5 ** 0.5 * (var.sqrt() * z1 + dev.T @ z2 / 2 ** 0.5)
    got = torch.cat([swag_model.module.weight.reshape(-1), swag_model.module.bias])
    torch.testing.assert_close(got, expected)


def test_sample_then_update_bn_is_what_attach_predict_gives_for_its_first_sample():
    model = _bn_net()
    swag_model = SWAGModel(model, max_rank=4)
    _train_and_collect(model, lambda: swag_model.update_parameters(model))
    loader = _loader(3, seed=7)
    attached = attach(SWAG(max_rank=4), copy.deepcopy(swag_model.module), None, train_loader=loader)
    attached.load_posterior_state(swag_model.swag.posterior_state())
    test_x = torch.randn(10, 4, generator=torch.Generator().manual_seed(9))
    first = next(attached.predict({"test": [(test_x, torch.zeros(10, dtype=torch.long))]}))["test"]

    swag_model.sample(generator=torch.Generator().manual_seed(attached.eval_seed))
    update_bn([x for x, _ in loader], swag_model)
    swag_model.eval()
    torch.testing.assert_close(F.log_softmax(swag_model(test_x), -1), first, rtol=1e-6, atol=1e-6)


def test_state_dict_round_trip_restores_the_posterior():
    model = _bn_net()
    swag_model = SWAGModel(model, max_rank=3)
    _train_and_collect(model, lambda: swag_model.update_parameters(model), steps=5)
    state = copy.deepcopy(swag_model.state_dict())
    fresh = SWAGModel(_bn_net(seed=4), max_rank=3)
    fresh.load_state_dict(state)
    for k, v in swag_model.swag.posterior_state().items():
        w = fresh.swag.posterior_state()[k]
        assert (torch.equal(v, w) if torch.is_tensor(v) else v == w), k
    a, b = (torch.Generator().manual_seed(2) for _ in range(2))
    swag_model.sample(generator=a)
    fresh.sample(generator=b)
    for p, q in zip(swag_model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_misuse_is_one_clear_error():
    swag_model = SWAGModel(_bn_net(), max_rank=3)
    with pytest.raises(RuntimeError, match="call update_parameters"):
        swag_model.sample()
    with pytest.raises(ValueError, match="do not match"):
        swag_model.update_parameters(nn.Linear(4, 3))


def test_swag_predict_on_a_batchnorm_net_without_train_loader_says_what_to_pass_and_loses_nothing():
    model = _bn_net()
    swag = attach(SWAG(max_rank=3, num_samples=2), model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train_and_collect(model, swag.collect, steps=3)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"attach\(\.\.\., train_loader=loader\), or the method's bn_refresh=False"):
        list(swag.predict({"test": _loader(1)}))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    no_refresh = attach(SWAG(max_rank=3, num_samples=2, bn_refresh=False), model, None)
    no_refresh.load_posterior_state(swag.posterior_state())
    assert len(list(no_refresh.predict({"test": _loader(1)}))) == 2  # the other way out works
