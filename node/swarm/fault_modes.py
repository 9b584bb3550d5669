"""The names of ``atoll run --byzantine`` modes, importable without torch (the command
line lists them in its help); :mod:`node.swarm.byzantine` implements them."""

from __future__ import annotations

__all__ = ["ALL_MODES", "COMMIT_MODES", "MODES", "QUIET_MODES", "mode_name", "parse_mode"]

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

COMMIT_MODES = ("equivocate", "skip_commit", "late_commit", "bad_owner", "split")
"""Attacks on the commit phase (they need ``control.commit = true`` to mean anything);
``bad_owner`` names, in its signed results, inputs other than the ones committed;
``split``, in a gather (``sync.exchange = "gather"``), commits to one part and sends one
member of its group another (claiming one token more), so that members would reduce
different inputs."""

QUIET_MODES = ("silent", "random_data", "poison", "lazy", "copy")
"""Faults that break no rule a receiver can check:

- ``silent`` announces and commits, then sends no part and answers nothing (``silent=F``
  does so in the share ``F`` of its exchanges, drawn by round and fragment, and is honest
  in the others: a peer that vanishes now and then);
- ``random_data`` trains honestly on random bytes (a broken data pipeline);
- ``poison`` trains honestly on its train tokens in reverse order (poisoned data);
- ``lazy`` runs one inner step in ten and claims the tokens of all ten (``lazy=F`` runs
  the share ``F`` of them: ``lazy=0.5`` half);
- ``copy`` sends the swarm's last change of each fragment's global copy as its own work.
"""

ALL_MODES = MODES + COMMIT_MODES + QUIET_MODES

_PARAMETERS = {"lazy": 0.1, "silent": 1.0}
"""Modes that take a parameter (``MODE=VALUE``), with its default."""


def parse_mode(text: str) -> tuple[str, float | None]:
    """``"lazy=0.5"`` to ``("lazy", 0.5)``; a mode without a parameter to ``(mode, None)``.

    Raises:
        ValueError: an unknown mode (naming the known ones), or a parameter where the
            mode takes none or out of ``(0, 1]``.
    """
    name, sep, value = text.partition("=")
    if name not in ALL_MODES:
        raise ValueError(f"--byzantine {name!r}: expected one of {', '.join(ALL_MODES)}")
    if name not in _PARAMETERS:
        if sep:
            raise ValueError(f"--byzantine {text!r}: {name} takes no parameter")
        return name, None
    if not sep:
        return name, _PARAMETERS[name]
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        what = "steps run" if name == "lazy" else "exchanges it is silent in"
        raise ValueError(f"--byzantine {text!r}: the share of {what} must be in (0, 1]")
    return name, share


def mode_name(text: str | None) -> str | None:
    """The mode's name without its parameter (None stays None)."""
    return None if text is None else text.partition("=")[0]
