"""The builders of a node's parts: the same training side on every node from the run's
seed, the control channel's view of live peers, and operator commands."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from node.build import Hearing, apply_operator, build_training
from node.config import load_config
from node.run.admin import Command
from node.train.site_leader import NoSite

TINY = [
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=2",
    "model.context=16",
    "sync.fragments=2",
    "data.batch_size=2",
    "train.eval_batches=1",
]


def _corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("every node builds the same model from the run's seed. " * 200)
    return str(path)


def test_two_nodes_build_the_same_model_and_one_residual_per_fragment(tmp_path) -> None:
    cfg = load_config(None, [*TINY, f"data.paths=[{_corpus(tmp_path)!r}]", "run.seed=7"])
    a = build_training(cfg, "peerA", None, None)
    b = build_training(cfg, "peerB", None, None)
    for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(x, y)
    assert len(a.plan) == 2 and len(a.feedback) == 2
    assert isinstance(a.site, NoSite) and a.device == torch.device("cpu")
    assert a.plan.numel == sum(p.numel() for p in a.model.parameters())
    bpb = a.evaluate_global()
    assert 0 < bpb < 20  # an untrained byte model: about 8 bits per byte


def test_another_seed_builds_other_weights(tmp_path) -> None:
    corpus = _corpus(tmp_path)
    one = build_training(load_config(None, [*TINY, f"data.paths=[{corpus!r}]"]), "p", None, None)
    cfg = load_config(None, [*TINY, f"data.paths=[{corpus!r}]", "run.seed=99"])
    other = build_training(cfg, "p", None, None)
    assert not all(
        torch.equal(x, y) for x, y in zip(one.model.parameters(), other.model.parameters())
    )


class _Control:
    def __init__(self) -> None:
        self.pardons: list[str] = []

    def heard(self) -> dict:
        return {"a": {"spec": "s1"}, "b": {"spec": "s2"}, "c": {}}

    def pardoned(self, peer: str) -> None:
        self.pardons.append(peer)


def test_peers_heard_count_only_with_this_runs_spec() -> None:
    hearing = Hearing("s1")
    assert hearing() == set()  # no control channel yet
    hearing.control = _Control()  # type: ignore[assignment]
    assert hearing() == {"a"}


def test_a_pardon_also_clears_the_control_planes_record_and_a_ban_does_not() -> None:
    from verification.identity import Identity

    x, y = Identity.generate().peer_id, Identity.generate().peer_id
    control = _Control()
    done: list[tuple[str, str]] = []
    verifier = SimpleNamespace(operator=lambda op, peer, reason: done.append((op, peer)) or {})
    apply_operator(verifier, control, Command(op="ban", peer=x, reason="r"))  # type: ignore[arg-type]
    apply_operator(verifier, control, Command(op="pardon", peer=x, reason="mistake"))  # type: ignore[arg-type]
    apply_operator(verifier, None, Command(op="pardon", peer=y, reason="mistake"))  # type: ignore[arg-type]
    assert done == [("ban", x), ("pardon", x), ("pardon", y)]
    assert control.pardons == [x]
