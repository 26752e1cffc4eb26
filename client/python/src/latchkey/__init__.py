"""Thin Python client for latchkey, the lock-coordinator gRPC service.

    import latchkey

    with latchkey.Client("127.0.0.1:50051") as client:
        with client.lock("orders", wait=10) as lease:
            write_with_token(lease.fencing_token)

The asyncio variant is ``latchkey.aio.Client``. Generated stubs: ``latchkey.v1``.
"""

from latchkey._client import Client, Lease, LockRequest, Watch
from latchkey._common import DISCONNECTED, RELEASE_TIMEOUT, REVOKED, LockError, LockTimeout
from latchkey.v1 import latchkey_pb2 as pb

LockKind = pb.LockKind
LockState = pb.LockState

__all__ = [
    "Client",
    "Lease",
    "LockRequest",
    "Watch",
    "LockError",
    "LockTimeout",
    "LockKind",
    "LockState",
    "DISCONNECTED",
    "REVOKED",
    "RELEASE_TIMEOUT",
    "pb",
]
__version__ = "0.1.0"
