"""What a run binds besides its settings: model config, first weights and tokenizer, by
digest; a node whose files differ from a spec's stops at start, naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.cli import main
from node.config import ConfigError, load_config
from node.data.corpus import stdlib_files
from node.data.prepare import prepare
from node.spec import settings_digest
from node.spec_file import read_spec
from node.train.bindings import bind
from node.train.hf import config_digest, load_config_dict

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "vocab_size": 400,
    "max_position_embeddings": 256,
}
BOOT = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bound")
    docs = root / "docs"
    docs.mkdir()
    for i, (_, path) in enumerate(stdlib_files()[:12]):
        (docs / f"d{i:02d}.txt").write_text(path.read_text())
    made = {}
    for name, vocab in (("shards_a", 400), ("shards_b", 380)):
        prepare([str(docs / "*.txt")], root / name, train_vocab=vocab)
        made[name] = root / name
    for name, width in (("config_a", 32), ("config_b", 48)):
        path = root / f"{name}.json"
        path.write_text(json.dumps({**TINY, "hidden_size": width}))
        made[name] = path
    return made


def _cfg(files: dict[str, Path], config: str = "config_a", shards: str = "shards_a"):
    return load_config(
        None,
        [
            "model.arch='hf'",
            f"model.hf_config={json.dumps(str(files[config]))}",
            f"data.shards={json.dumps(str(files[shards]))}",
        ],
    )


def test_bind_fills_in_the_digests_of_what_the_files_hold(files) -> None:
    bound = bind(_cfg(files))
    meta = json.loads((files["shards_a"] / "meta.json").read_text())
    assert bound.data.tokenizer_digest == meta["tokenizer"]["digest"]
    assert bound.model.config_digest == config_digest(load_config_dict(bound.model))
    assert bind(bound) == bound  # bound again: the same
    # a preset takes its vocabulary from the tokenizer; bytes need no tokenizer
    preset = bind(
        load_config(
            None,
            [
                "model.arch='hf'",
                "model.preset='llama-tiny'",
                f"data.shards={json.dumps(str(files['shards_b']))}",
            ],
        )
    )
    assert preset.model.vocab_size == 380
    assert bind(load_config(None, [])).data.tokenizer_digest == "bytes"
    # nodes without a spec on other model configs or tokenizers do not see each other
    other_model = bind(_cfg(files, config="config_b"))
    other_tokens = bind(_cfg(files, shards="shards_b"))
    digests = {settings_digest(c) for c in (bound, other_model, other_tokens)}
    assert len(digests) == 3


def test_a_digest_that_the_files_do_not_have_is_refused(files) -> None:
    bound = bind(_cfg(files))
    moved = bound.replace(model={"hf_config": str(files["config_b"])})
    with pytest.raises(
        ConfigError, match=r"model.config_digest = .* \(the run's\) but model.hf_config's"
    ):
        bind(moved)
    other = bound.replace(data={"shards": str(files["shards_b"])})
    with pytest.raises(ConfigError, match=r"data.tokenizer_digest = .* but data.shards' tokenizer"):
        bind(other)


@pytest.fixture
def spec(files, tmp_path: Path, capsys) -> Path:
    config = tmp_path / "creator.toml"
    config.write_text(
        f'[run]\nrun_id = "bound"\n[model]\narch = "hf"\nhf_config = {json.dumps(str(files["config_a"]))}\n'
        f"[data]\nshards = {json.dumps(str(files['shards_a']))}\n"
    )
    args = ["spec", "create", "--config", str(config), "--data-dir", str(tmp_path / "creator")]
    assert (
        main(
            [*args, "--bootstrap", BOOT, "--t0", "2000000000", "--out", str(tmp_path / "run.toml")]
        )
        == 0
    )
    capsys.readouterr()
    return tmp_path / "run.toml"


def _run(spec: Path, tmp_path: Path, files, monkeypatch, **chosen: str) -> list:
    """``atoll run --spec`` with this node's own files; a Node that passes its checks
    is recorded instead of started."""
    import node.daemon

    started: list = []
    monkeypatch.setattr(node.daemon.Node, "run", lambda self: started.append(self.cfg) or 0)
    local = tmp_path / "volunteer.toml"
    local.write_text(
        f"[model]\nhf_config = {json.dumps(str(files[chosen.get('config', 'config_a')]))}\n"
        f"[data]\nshards = {json.dumps(str(files[chosen.get('shards', 'shards_a')]))}\n"
    )
    code = main(
        ["run", "--spec", str(spec), "--config", str(local), "--data-dir", str(tmp_path / "v")]
    )
    return [code, started]


def test_the_spec_binds_the_creators_model_config_and_tokenizer(spec: Path, files) -> None:
    shared = read_spec(spec).shared
    meta = json.loads((files["shards_a"] / "meta.json").read_text())
    assert shared["data"]["tokenizer_digest"] == meta["tokenizer"]["digest"]
    assert shared["model"]["config_digest"] == config_digest({**TINY})
    assert "hf_config" not in shared["model"]  # a path is each node's own


@pytest.mark.parametrize(
    "chosen, key",
    [
        ({"config": "config_b"}, "model.config_digest"),
        ({"shards": "shards_b"}, "data.tokenizer_digest"),
    ],
)
def test_a_node_with_another_model_config_or_tokenizer_stops_at_start(
    spec: Path, tmp_path: Path, files, monkeypatch, capsys, chosen: dict, key: str
) -> None:
    code, started = _run(spec, tmp_path, files, monkeypatch, **chosen)
    err = capsys.readouterr().err.strip()
    assert code == 2 and not started
    assert err.startswith(f"atoll: config error: {key} = ") and "\n" not in err


def test_a_node_with_the_runs_files_starts(spec: Path, tmp_path: Path, files, monkeypatch) -> None:
    code, started = _run(spec, tmp_path, files, monkeypatch)
    assert code == 0 and len(started) == 1
    assert started[0].model.config_digest == read_spec(spec).shared["model"]["config_digest"]
