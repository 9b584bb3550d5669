"""Signed formats on the wire: envelopes, part messages, tensor codecs and msgpack limits."""
