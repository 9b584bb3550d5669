import pytest
import torch

from node.config import ModelConfig
from node.train.model import build_model
from protocol.averaging.fragments import plan_fragments


def test_partition_exact_and_balanced():
    model = build_model(ModelConfig(), seed=0)
    params = dict(model.named_parameters())
    for count in (1, 2, 4, 7):
        plan = plan_fragments(model, count)
        names = [n for f in plan.fragments for n in f.names]
        assert sorted(names) == sorted(params)
        assert len(names) == len(set(names))
        assert plan.numel == sum(p.numel() for p in params.values())
        sizes = [f.numel for f in plan.fragments]
        largest = max(p.numel() for p in params.values())
        # LPT: no fragment exceeds the ideal share by more than one tensor.
        assert max(sizes) - plan.numel / count <= largest


def test_hand_computed_plan():
    shapes = [("a", (10,)), ("b", (6,)), ("c", (5,)), ("d", (4,))]
    plan = plan_fragments(shapes, 2)
    # LPT: a(10)->0, b(6)->1, c(5)->1 (6 < 10), d(4)->0 (10 < 11).
    assert plan[0].names == ("a", "d") and plan[1].names == ("b", "c")
    assert [f.numel for f in plan.fragments] == [14, 11]


def test_same_plan_on_every_node():
    a = plan_fragments(build_model(ModelConfig(), seed=0), 3)
    b = plan_fragments(build_model(ModelConfig(), seed=9), 3)
    assert a == b and a.digest() == b.digest()
    assert a.digest() != plan_fragments(build_model(ModelConfig(), seed=0), 2).digest()


def test_flatten_write_round_trip_bitwise():
    model = build_model(ModelConfig(), seed=0)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    plan = plan_fragments(model, 4)
    vectors = [plan.flatten(params, i) for i in range(len(plan))]
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    for i, v in enumerate(vectors):
        plan.write(params, i, v)
    for n, p in params.items():
        assert torch.equal(p, before[n])


def test_errors():
    model = build_model(ModelConfig(n_layer=1), seed=0)
    with pytest.raises(ValueError, match="exceeds"):
        plan_fragments(model, 1000)
    with pytest.raises(ValueError, match=">= 1"):
        plan_fragments(model, 0)
    plan = plan_fragments(model, 2)
    with pytest.raises(ValueError, match="holds"):
        plan.write(dict(model.named_parameters()), 0, torch.zeros(3))
