"""The committed stubs match what ./generate.sh makes from the proto now."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]
FILES = ["latchkey_pb2.py", "latchkey_pb2.pyi", "latchkey_pb2_grpc.py"]

# Lines that name the generator's version, which may vary between grpcio-tools releases.
_VERSION_LINES = [
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
    re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,", re.M),
]


def _normalize(text: str) -> str:
    text = _VERSION_LINES[0].sub("# Protobuf Python Version: X", text)
    text = _VERSION_LINES[1].sub("GRPC_GENERATED_VERSION = X", text)
    return _VERSION_LINES[2].sub(r"\1 X,", text)


def test_generated_stubs_are_up_to_date(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(PKG / "generate.sh"), str(tmp_path)], check=True, env=env, timeout=120)
    for f in FILES:
        committed = PKG / "src" / "latchkey" / "v1" / f
        fresh = tmp_path / "latchkey" / "v1" / f
        assert committed.is_file(), f"{committed} missing: run ./generate.sh"
        assert _normalize(committed.read_text()) == _normalize(fresh.read_text()), (
            f"{committed.name} is out of date with proto/latchkey/v1/latchkey.proto: run client/python/generate.sh"
        )
