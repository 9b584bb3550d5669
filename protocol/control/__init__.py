"""The control plane: heartbeats, round commitments and verdicts over a GossipSub channel
(:mod:`~protocol.control.plane`), its signed frames and the py-libp2p sidecar process."""
