"""Averaging fragments among peers: parts and their owners, the all-reduce, repair, matchmaking, grouping and one fragment's exchange."""
