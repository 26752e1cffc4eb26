"""Generated stubs for latchkey.v1 (see generate.sh)."""
