#!/usr/bin/env bash
# Regenerates the committed gRPC stubs in src/latchkey/v1/ from proto/latchkey/v1/latchkey.proto.
# Needs grpcio-tools==1.80.1 (the dev extras: pip install -e '.[dev]', or ./run-tests once).
# Usage: ./generate.sh [OUT_DIR]  (default: src); $PYTHON selects the interpreter.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/src}"
# Prefer the run-tests venv (it has the pinned grpcio-tools), else python3.
venv_python="$here/../../target/tools/python-client-venv/bin/python"
if [ -z "${PYTHON:-}" ] && [ -x "$venv_python" ]; then PYTHON="$venv_python"; fi
python="${PYTHON:-python3}"
mkdir -p "$out"
cd "$here"
"$python" -m grpc_tools.protoc \
  -I ../../proto \
  --python_out="$out" \
  --pyi_out="$out" \
  --grpc_python_out="$out" \
  latchkey/v1/latchkey.proto
