#!/usr/bin/env bash
# The GPU study (benchmarks/gpu.py) on a machine that has a GPU, Python and torch, and
# nothing else of this project's environment nor a package index. The wheels the node
# needs besides torch come from `make wheelhouse` (dev/wheelhouse.py), in parts small
# enough for one call to a lent machine each:
#
#   dev/gpu-study.sh install DIR   install the wheels in DIR (one part) into .gpu-site
#                                  (pip --target: the machine's own torch stays in use)
#   dev/gpu-study.sh run [OUT]     python -m benchmarks gpu --out OUT (default: $OUT, else
#                                  benchmarks/results), the source and .gpu-site on
#                                  PYTHONPATH
#
# The machine's Python must be the version the wheels were built for (DIR/python.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
site=.gpu-site
python=${PYTHON:-python3}

case "${1:-}" in
install)
    dir=${2:?gpu-study: install needs the folder of wheels}
    "$python" -c "import torch" 2>/dev/null || {
        echo "gpu-study: $python cannot import torch; install torch first" >&2
        exit 2
    }
    have=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    want=$(cat "$dir/python.txt")
    if [ "$have" != "$want" ]; then
        echo "gpu-study: the wheels in $dir are for Python $want; $python is $have" >&2
        exit 2
    fi
    "$python" -m pip install --quiet --no-index --no-deps --target "$site" "$dir"/*.whl
    echo "gpu-study: installed $(ls "$dir"/*.whl | wc -l) wheels from $dir into $site"
    ;;
run)
    out=${2:-${OUT:-benchmarks/results}}
    test -d "$site/hivemind" || {
        echo "gpu-study: no $site/hivemind; run 'dev/gpu-study.sh install DIR' for each part first" >&2
        exit 2
    }
    HF_HUB_OFFLINE=1 PYTHONPATH="$PWD:$PWD/$site${PYTHONPATH:+:$PYTHONPATH}" \
        "$python" -m benchmarks gpu --out "$out" "${@:3}"
    ;;
*)
    echo "usage: dev/gpu-study.sh install DIR | run [OUT] [--smoke]" >&2
    exit 2
    ;;
esac
