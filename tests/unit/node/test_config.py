from pathlib import Path

import pytest

from node.config import AtollConfig, ConfigError, load_config, parse_overrides


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, AtollConfig)
    assert cfg.outer.optimizer == "nesterov" and cfg.outer.lr == 0.7 and cfg.outer.momentum == 0.5


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[sync]\ncodec = "int8"\ninner_steps = 10\n[model]\nn_layer = 3\n')
    cfg = load_config(path, ["sync.inner_steps=20", "data.paths=['a', 'b']"])
    assert cfg.sync.codec == "int8"
    assert cfg.sync.inner_steps == 20
    assert cfg.model.n_layer == 3
    assert cfg.data.paths == ("a", "b")


def test_bad_choice_names_key_and_choices():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["sync.codec=avg"])
    assert str(info.value) == (
        "config error: sync.codec = 'avg': expected one of none, fp16, bf16, int8, int4, topk"
    )


@pytest.mark.parametrize(
    "override, fragment",
    [
        (["sync.nope=1"], "unknown key 'sync.nope'"),
        (["train.lr=-1"], "train.lr = -1"),
        (["model.n_layer='x'"], "model.n_layer = 'x'"),
        (["sync=1"], "expected section.key=value"),
        (["noequals"], "expected key=value"),
    ],
)
def test_errors_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match="config error") as info:
        load_config(None, override)
    assert fragment in str(info.value)


def test_broken_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[sync\ncodec=")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    section = tmp_path / "section.toml"
    section.write_text("sync = 3\n")
    with pytest.raises(ConfigError, match=r"\[sync\] must be a table"):
        load_config(section)


def test_parse_overrides_types():
    out = parse_overrides(["a.b=1", "a.c=true", "a.d=hello", "b.e=1.5"])
    assert out == {"a": {"b": 1, "c": True, "d": "hello"}, "b": {"e": 1.5}}


def test_replace_revalidates():
    cfg = load_config()
    assert cfg.replace(sync={"fragments": 3}).sync.fragments == 3
    with pytest.raises(ConfigError):
        cfg.replace(sync={"fragments": 0})


def test_shipped_configs_validate():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "configs"
    files = sorted(root.glob("*.toml"))
    assert {f.name for f in files} >= {"local-swarm.toml", "volunteer.toml", "neocloud.toml"}
    for path in files:
        cfg = load_config(path)
        assert cfg.run.run_id
    # the real-model configs name presets that build (counted on the meta device)
    import torch

    from node.train.hf import load_config_dict
    from node.train.model import build_model

    for name in ("llama-tiny", "llama-150m", "llama-1b"):
        cfg = load_config(root / f"{name}.toml")
        assert cfg.model.arch == "hf" and cfg.model.preset == name
        assert cfg.model.context <= load_config_dict(cfg.model)["max_position_embeddings"]
        if name != "llama-1b":  # (building even its meta tensors takes seconds)
            with torch.device("meta"):
                params = sum(p.numel() for p in build_model(cfg.model).parameters())
            assert params > {"llama-tiny": 3e6, "llama-150m": 1.4e8}[name]
    local = load_config(root / "local-swarm.toml")
    assert local.sync.trigger == "seconds" and local.sync.codec == "int8"
    # every round's syncs (and their deadlines) fit inside the round
    assert (
        local.network.matchmaking_seconds + local.network.round_timeout < local.sync.round_seconds
    )


def test_stochastic_rounding_needs_integer_codec():
    with pytest.raises(ConfigError, match="stochastic_rounding needs codec int8, int4 or topk"):
        load_config(None, ["sync.stochastic_rounding=true"])
    assert (
        load_config(None, ["sync.codec=int4", "sync.stochastic_rounding=true"]).sync.codec == "int4"
    )


def test_nesterov_without_momentum_is_a_config_error_and_sgd_is_not():
    with pytest.raises(ConfigError, match="Nesterov needs momentum > 0"):
        load_config(None, ["outer.momentum=0"])
    cfg = load_config(None, ["outer.optimizer='sgd'", "outer.momentum=0", "outer.lr=1.0"])
    assert (cfg.outer.optimizer, cfg.outer.momentum, cfg.outer.lr) == ("sgd", 0.0, 1.0)


def test_client_mode_makes_a_node_a_client_for_parts_too(tmp_path):
    from node.settings import transport_config

    cfg = load_config(None, ["network.client_mode=true"])
    assert transport_config(cfg, tmp_path / "k", ()).reachability == "private"
    assert transport_config(load_config(None, []), tmp_path / "k", ()).reachability == "auto"
    with pytest.raises(ConfigError, match="client_mode = true says peers cannot dial"):
        load_config(None, ["network.client_mode=true", "network.reachability='public'"])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("initial_peers", '["10.0.0.1:31337"]', "is not a multiaddr"),
        ("initial_peers", '["/ip4/10.0.0.1/tcp/31337"]', "needs its peer id"),
        ("trusted_relays", '["/ip4/10.0.0.1/tcp/1"]', "needs its peer id"),
        ("announce_maddrs", '["203.0.113.5"]', "is not a multiaddr"),
    ],
)
def test_bad_multiaddrs_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=f"network.{key}: .*{message}"):
        load_config(None, [f"network.{key}={value}"])
    load_config(None, ['network.announce_maddrs=["/ip4/203.0.113.5/tcp/31337"]'])


def test_data_plane_reaches_the_transport_and_bad_values_name_the_key(tmp_path):
    from node.settings import transport_config
    from protocol.p2p.transport import TransportConfig

    cfg = load_config(None, ["network.data_plane='tcp'", "network.data_port=31339"])
    transport = transport_config(cfg, tmp_path / "k", ())
    assert (transport.data_plane, transport.data_port) == ("tcp", 31339)
    assert transport_config(load_config(None, []), tmp_path / "k", ()).data_plane == "p2pd"
    tls = load_config(None, ["network.data_plane='tls'"])
    assert transport_config(tls, tmp_path / "k", ()).data_plane == "tls"
    with pytest.raises(ConfigError, match="network.data_plane = 'udp'"):
        load_config(None, ["network.data_plane='udp'"])
    with pytest.raises(ConfigError, match="network.data_port"):
        load_config(None, ["network.data_port=70000"])
    for plane in ("tcp", "tls"):
        with pytest.raises(ValueError, match="give identity_path"):
            TransportConfig(data_plane=plane)  # type: ignore[arg-type]


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
def test_topk_refuses_coordinatewise_aggregators_naming_both_keys(aggregator: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["sync.codec='topk'", f"trust.aggregator='{aggregator}'"])
    message = str(info.value)
    assert message.startswith(f"config error: trust.aggregator = '{aggregator}' cannot work")
    assert "sync.codec = 'topk'" in message and "\n" not in message
    for accepted in ("mean", "centered_clip", "clipped_mean", "krum"):
        params = ["trust.aggregator_params={f = 0}"] if accepted == "krum" else []
        cfg = load_config(None, ["sync.codec='topk'", f"trust.aggregator='{accepted}'", *params])
        assert cfg.trust.aggregator == accepted


def test_replay_checks_are_refused_with_a_local_share_of_the_sync_with_what_to_do():
    keys = ["trust.checkers=2", "trust.replay_steps=4", "sync.alpha=0.5"]
    with pytest.raises(ConfigError, match="sync.alpha = 0.5: .*set sync.alpha = 0"):
        load_config(None, keys)
    load_config(None, keys[:2] + ["sync.alpha=0"])
    load_config(None, ["trust.checkers=0", "trust.replay_steps=4", "sync.alpha=0.5"])


def test_replay_checks_are_refused_on_an_fsdp_site_with_what_to_do():
    with pytest.raises(ConfigError, match="trust.replay_steps with train.sharding = 'fsdp'"):
        load_config(None, ["trust.checkers=2", "trust.replay_steps=4", "train.sharding='fsdp'"])
    # off, it is not in the way
    assert load_config(None, ["train.sharding='fsdp'"]).trust.replay_steps == 0


def test_the_public_swarm_config_replays_windows():
    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "volunteer.toml")
    assert cfg.trust.checkers == 2 and cfg.trust.replay_steps == 8
