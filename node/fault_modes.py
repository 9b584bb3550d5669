"""The names of ``atoll run --byzantine`` modes, importable without torch (the command
line lists them in its help); :mod:`node.byzantine` implements them."""

from __future__ import annotations

__all__ = ["ALL_MODES", "COMMIT_MODES", "MODES", "QUIET_MODES"]

MODES = (
    "sign_flip",
    "scale",
    "noise",
    "nan",
    "zero",
    "alie",
    "ipm",
    "replay",
    "wrong_shape",
    "bad_signature",
    "inflated_tokens",
    "malicious_owner",
)

COMMIT_MODES = ("equivocate", "skip_commit", "late_commit", "bad_owner")
"""Attacks on the commit phase (they need ``control.commit = true`` to mean anything);
``bad_owner`` names, in its signed results, inputs other than the ones committed."""

QUIET_MODES = ("silent", "random_data", "poison", "lazy", "copy")
"""Faults that break no rule a receiver can check:

- ``silent`` announces and commits, then sends no part and answers nothing;
- ``random_data`` trains honestly on random bytes (a broken data pipeline);
- ``poison`` trains honestly on its train tokens in reverse order (poisoned data);
- ``lazy`` runs one inner step in ten and claims the tokens of all ten;
- ``copy`` sends the swarm's last change of each fragment's global copy as its own work.
"""

ALL_MODES = MODES + COMMIT_MODES + QUIET_MODES
