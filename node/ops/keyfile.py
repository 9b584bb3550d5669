"""The node's identity key file, read (or made on first start) with errors an operator
can act on.

Light on purpose: ``atoll run`` checks the key before it loads torch, so a broken key
is one line within a second.
"""

from __future__ import annotations

from pathlib import Path

from verification.errors import VerificationError
from verification.identity import Identity

__all__ = ["load_identity"]


def load_identity(key_file: Path) -> Identity:
    """The node's key, made on first start.

    Raises:
        ValueError: the file is not a key, or is a directory (with what to do).
    """
    new = "to make a new identity (the node gets a new PeerID)"
    try:
        return Identity.load_or_create(key_file)
    except VerificationError as exc:
        detail = exc.detail.removeprefix(f"{key_file}: ")
        raise ValueError(
            f"{key_file} is not a valid identity key ({detail}); "
            f"restore it from a backup or delete it {new}"
        ) from exc
    except IsADirectoryError as exc:
        raise ValueError(
            f"{key_file} is a directory, not an identity key file; put the key file "
            f"back from a backup, or remove the directory {new}"
        ) from exc
