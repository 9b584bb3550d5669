"""``python -m node.cli``: the ``atoll`` command."""

import sys

from node.cli import main

sys.exit(main())
