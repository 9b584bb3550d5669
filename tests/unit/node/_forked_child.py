"""A module the fork server's tests run as ``python -m``: reports what it was given."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    code, seconds = int(sys.argv[1]), float(sys.argv[2])
    report = {
        "argv": sys.argv[1:],
        "env": os.environ.get("FORKED_CHILD_MARK"),
        "cwd": os.getcwd(),
        "stdin": sys.stdin.read(),
        "leader": os.getsid(0) == os.getpid(),
        "name": __name__,
    }
    print(json.dumps(report))
    print("to stderr", file=sys.stderr)
    time.sleep(seconds)
    sys.exit(code)
