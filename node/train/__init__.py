"""How a node trains: the loop, its schedule and clock, the sync, the outer step, a round's end, checkpoints, and a site of many ranks."""
