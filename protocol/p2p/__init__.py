"""The network underneath: p2pd and the DHT behind a synchronous facade, RPC framing, addresses, reachability, the watchdog and the emulated link."""
