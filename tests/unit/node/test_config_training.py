"""The run, model, data, train and outer sections: each refuses what cannot work, naming
the key."""

from __future__ import annotations

import pytest

from node.config_training import DataConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig

PEER_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def test_devices_are_auto_cpu_cuda_or_one_cuda_device() -> None:
    for device in ("auto", "cpu", "cuda", "cuda:3"):
        assert RunConfig(device=device).device == device
    for bad in ("gpu", "cuda:x", "mps"):
        with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
            RunConfig(device=bad)


def test_clock_signers_are_peer_ids() -> None:
    assert RunConfig(clock_signers=(PEER_ID,)).clock_signers == (PEER_ID,)
    with pytest.raises(ValueError, match="is not a PeerID"):
        RunConfig(clock_signers=("alice",))


def test_a_model_comes_from_one_source_and_hugging_face_keys_need_hf() -> None:
    with pytest.raises(ValueError, match="set model.arch = 'hf'"):
        ModelConfig(preset="llama-tiny")
    with pytest.raises(ValueError, match="both set"):
        ModelConfig(arch="hf", preset="llama-tiny", hf_config="config.json")
    with pytest.raises(ValueError, match="init_digest binds"):
        ModelConfig(arch="hf", preset="llama-tiny", init_digest="ab" * 32)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ModelConfig(vocab_size=1)


def test_a_site_is_one_of_the_sites_and_a_corpus_has_one_source() -> None:
    assert DataConfig(site=2, sites=3).site == 2
    with pytest.raises(ValueError, match="numbered 0 to 2"):
        DataConfig(site=3, sites=3)
    with pytest.raises(ValueError, match="train on one or the other"):
        DataConfig(shards="out", paths=("*.txt",))


def test_whole_matrix_optimizers_refuse_sharded_weights() -> None:
    assert TrainConfig(optimizer="muon", sharding="ddp").optimizer == "muon"
    with pytest.raises(ValueError, match="needs whole weight matrices"):
        TrainConfig(optimizer="soap", sharding="fsdp")


def test_the_outer_step_checks_momentum_warmup_and_schedule() -> None:
    assert OuterConfig().lr == 0.7 and OuterConfig().momentum == 0.5
    with pytest.raises(ValueError, match="Nesterov needs momentum > 0"):
        OuterConfig(momentum=0.0)
    with pytest.raises(ValueError, match="warm-up applies to nesterov and sgd"):
        OuterConfig(optimizer="Adam", momentum_warmup=5)
    with pytest.raises(ValueError, match="lr_rounds >= 1"):
        OuterConfig(lr_schedule="cosine")
