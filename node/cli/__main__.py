"""``python -m node.cli``: the ``atoll`` command."""

from node.cli import console

console()
