"""The GossipSub control channel: the node-side channel, its signed frames and the py-libp2p sidecar process."""
