"""A node among its peers: who is in the run, joining it, and the fault modes of tests."""
