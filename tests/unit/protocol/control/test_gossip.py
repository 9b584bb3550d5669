"""The py-libp2p side of the sidecar: the node key as a libp2p key pair, and GossipSub
with Atoll's settings.

py-libp2p cannot be imported next to hivemind, so each check runs in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from verification.identity import Identity

ROOT = Path(__file__).resolve().parents[4]


def _python(code: str, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_libp2p_derives_the_peer_id_atoll_derives_from_the_node_key(tmp_path: Path) -> None:
    identity = Identity.from_seed(b"g" * 32)
    identity.save(tmp_path / "identity.key")
    (tmp_path / "junk.key").write_bytes(b"not a key")
    out = _python(
        """
        import json, sys
        from libp2p.peer.id import ID
        from protocol.control._gossip import load_key_pair
        pair = load_key_pair(sys.argv[1])
        try:
            load_key_pair(sys.argv[2])
            junk = "loaded"
        except Exception as e:
            junk = type(e).__name__
        print(json.dumps({"peer": ID.from_pubkey(pair.public_key).to_base58(), "junk": junk}))
        """,
        str(tmp_path / "identity.key"),
        str(tmp_path / "junk.key"),
    )
    assert out["peer"] == identity.peer_id
    assert out["junk"] != "loaded"


def test_the_router_runs_gossipsub_with_atolls_mesh_and_heartbeat() -> None:
    out = _python(
        """
        import json
        from protocol.control._gossip import GOSSIP, new_router
        router = new_router()
        print(json.dumps({
            "degree": [router.degree, router.degree_low, router.degree_high],
            "heartbeat": router.heartbeat_interval,
            "settings": [GOSSIP.degree, GOSSIP.degree_low, GOSSIP.degree_high, GOSSIP.heartbeat_s],
        }))
        """
    )
    assert out["degree"] == out["settings"][:3] == [6, 4, 12]
    assert out["heartbeat"] == out["settings"][3] == 1


def test_the_process_wide_patch_sizes_the_queues_counts_drops_and_applies_once() -> None:
    out = _python(
        """
        import json
        from libp2p.peer.id import ID
        from libp2p.pubsub import gossipsub, pubsub
        from libp2p.pubsub.pb import rpc_pb2
        from protocol.control._patch import LIBP2P_DROPS, patch_libp2p
        patch_libp2p(7, 9)
        drop = pubsub.drop_rpc
        patch_libp2p(100, 100)  # a second call changes nothing
        queue = pubsub.RpcQueue()
        kept = sum(queue.push(rpc_pb2.RPC()) for _ in range(10))
        pubsub.drop_rpc(ID(b"x"), rpc_pb2.RPC())
        print(json.dumps({
            "kept": kept,
            "channel": pubsub.SUBSCRIPTION_CHANNEL_SIZE,
            "same": pubsub.drop_rpc is drop is gossipsub.drop_rpc,
            "drops": dict(LIBP2P_DROPS),
        }))
        """
    )
    assert out["kept"] == 7 and out["channel"] == 9 and out["same"]
    assert out["drops"] == {"outbound_control_dropped": 1}
