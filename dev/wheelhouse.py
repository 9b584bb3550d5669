"""Write the wheels a node needs besides torch into a folder, for a GPU machine that has
torch and nothing else and cannot reach a package index (``dev/gpu-study.sh``).

What goes in is what the node's processes import, found by importing them here: the
daemon, the CLI, the control channel's sidecar (py-libp2p), the benchmarks the GPU study
runs and a Llama from ``transformers``; each imported module's distribution at the
version installed in this environment, without torch and the distributions torch itself
brings (the GPU machine's own are used); ``numpy`` is in (torch's wheels do not bring it).

``python dev/wheelhouse.py OUT`` gets them with ``pip wheel --no-deps``
(a wheel from the index where there is one; built here where there is only a source
archive), so for this interpreter's Python version and platform, which the GPU machine's
must match; it writes ``OUT/requirements.txt`` (the pins, one a line) and
``OUT/python.txt`` (the version, also in every part) beside them. The wheels are then shared out into
``OUT/1``, ``OUT/2``, ... of at most ``--part-mib`` MiB each (56), so that each part fits
what one call to a lent machine carries (64 MiB with the source); ``dev/gpu-study.sh install`` takes one
part at a time.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import pathlib
import shutil
import subprocess
import sys

_ENTRY_POINTS = (
    (
        "node.daemon",
        "node.cli.running",
        "node.ops.swarm",
        "node.ops.simulate",
        "node.train.hf",
        "protocol.control.plane",
        "benchmarks.gpu",
        "benchmarks.cuda_site",
        "transformers.models.llama.modeling_llama",
        "datasets",  # atoll data prepare reads its inputs through it
    ),
    ("protocol.control.sidecar", "protocol.control._gossip"),
)
"""The node's process and the control channel's sidecar process: imported apart, as they
run (hivemind's and py-libp2p's protobuf modules cannot share a process)."""
_TORCH_BRINGS = {
    "torch", "filelock", "fsspec", "jinja2", "markupsafe", "mpmath", "networkx",
    "setuptools", "sympy", "typing-extensions", "triton", "atoll",
}  # fmt: skip


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def imported(modules: list[str]) -> dict[str, str]:
    """Distribution -> version of every module that importing ``modules`` imports, torch
    and what it brings left out."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise SystemExit(f"wheelhouse: cannot import {module} here: {e}") from None
    owners = md.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    found: dict[str, str] = {}
    for top in {name.split(".")[0] for name in sys.modules}:
        if top in stdlib:
            continue
        for dist in owners.get(top, []):
            key = _key(dist)
            if key in _TORCH_BRINGS or key.startswith("nvidia-"):
                continue
            found[key] = md.version(dist)
    return found


def needed() -> dict[str, str]:
    """What every process of :data:`_ENTRY_POINTS` imports, each group in a fresh
    interpreter."""
    found: dict[str, str] = {}
    root = pathlib.Path(__file__).resolve().parents[1]
    for group in _ENTRY_POINTS:
        out = subprocess.run(
            [sys.executable, __file__, "--imports", ",".join(group)],
            check=True,
            capture_output=True,
            text=True,
            cwd=root,
        )
        found.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return dict(sorted(found.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path, nargs="?")
    parser.add_argument("--part-mib", type=float, default=56.0)
    parser.add_argument("--imports", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    if args.imports:
        print(json.dumps(imported(args.imports.split(","))))
        return 0
    if args.out is None:
        parser.error("the folder to write the wheels into is missing")
    pins = needed()
    args.out.mkdir(parents=True, exist_ok=True)
    requirements = args.out / "requirements.txt"
    requirements.write_text("".join(f"{k}=={v}\n" for k, v in pins.items()))
    (args.out / "python.txt").write_text(f"{sys.version_info[0]}.{sys.version_info[1]}\n")
    subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
            "--wheel-dir", str(args.out), "--requirement", str(requirements),
        ],
        check=True,
    )  # fmt: skip
    wheels = sorted(args.out.glob("*.whl"), key=lambda p: -p.stat().st_size)
    size = sum(p.stat().st_size for p in wheels)
    parts = share_out([(p.name, p.stat().st_size) for p in wheels], args.part_mib * 2**20)
    for i, names in enumerate(parts, 1):
        (args.out / str(i)).mkdir(exist_ok=True)
        shutil.copy(args.out / "python.txt", args.out / str(i) / "python.txt")
        for name in names:
            (args.out / name).rename(args.out / str(i) / name)
    print(
        f"wheelhouse: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {len(parts)} part(s) "
        f"under {args.out}"
    )
    return 0


def share_out(sizes: list[tuple[str, int]], limit: float) -> list[list[str]]:
    """Names shared out into as few parts of at most ``limit`` bytes as first fit finds,
    largest first.

    Raises:
        SystemExit: a wheel larger than ``limit`` on its own.
    """
    parts: list[tuple[int, list[str]]] = []
    for name, size in sorted(sizes, key=lambda s: -s[1]):
        if size > limit:
            raise SystemExit(f"wheelhouse: {name} alone is over {limit / 2**20:.0f} MiB")
        for i, (used, names) in enumerate(parts):
            if used + size <= limit:
                parts[i] = (used + size, [*names, name])
                break
        else:
            parts.append((size, [name]))
    return [names for _, names in parts]


if __name__ == "__main__":
    raise SystemExit(main())
