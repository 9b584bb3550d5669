import pytest
import torch

from node.config import ModelConfig
from node.train.model import VOCAB_SIZE, ByteGPT, build_model


def tiny_factory(cfg: ModelConfig) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB_SIZE, 8), torch.nn.Linear(8, VOCAB_SIZE))


def not_a_module(cfg: ModelConfig) -> int:
    return 3


def test_shapes_and_causality():
    model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, context=12), seed=0)
    x = torch.randint(0, 256, (2, 12))
    out = model(x)
    assert out.shape == (2, 12, VOCAB_SIZE)
    # Changing a later byte must not change earlier predictions.
    y = x.clone()
    y[:, 8] = (y[:, 8] + 1) % 256
    torch.testing.assert_close(model(y)[:, :8], out[:, :8])
    assert not torch.allclose(model(y)[:, 8:], out[:, 8:])


def test_untrained_loss_near_eight_bits():
    model = build_model(ModelConfig(), seed=0)
    x = torch.randint(0, 256, (4, 64))
    logits = model(x)
    nats = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x.reshape(-1))
    assert abs(nats.item() / torch.log(torch.tensor(2.0)).item() - 8.0) < 0.2


def test_same_seed_same_weights():
    a = build_model(ModelConfig(), seed=3)
    b = build_model(ModelConfig(), seed=3)
    c = build_model(ModelConfig(), seed=4)
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_factory_and_errors():
    m = build_model(ModelConfig(factory="tests.unit.node.train.test_model:tiny_factory"))
    assert isinstance(m, torch.nn.Sequential)
    for bad, match in [
        ("nocolon", "expected 'package.module:function'"),
        ("no.such.module:f", "No module named"),
        ("tests.unit.node.train.test_model:missing", "has no attribute"),
        ("tests.unit.node.train.test_model:not_a_module", "not nn.Module"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_model(ModelConfig(factory=bad))
    with pytest.raises(ValueError, match="divisible"):
        ByteGPT(ModelConfig(n_embd=30, n_head=4))


def test_too_long_input_rejected():
    model = build_model(ModelConfig(context=8, n_embd=16, n_head=2, n_layer=1))
    with pytest.raises(ValueError, match="exceeds model.context"):
        model(torch.zeros(1, 9, dtype=torch.long))
