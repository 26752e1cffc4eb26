import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LockKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOCK_KIND_UNSPECIFIED: _ClassVar[LockKind]
    LOCK_KIND_MUTEX: _ClassVar[LockKind]
    LOCK_KIND_FAIR: _ClassVar[LockKind]
    LOCK_KIND_READ: _ClassVar[LockKind]
    LOCK_KIND_WRITE: _ClassVar[LockKind]
    LOCK_KIND_SEMAPHORE: _ClassVar[LockKind]
LOCK_KIND_UNSPECIFIED: LockKind
LOCK_KIND_MUTEX: LockKind
LOCK_KIND_FAIR: LockKind
LOCK_KIND_READ: LockKind
LOCK_KIND_WRITE: LockKind
LOCK_KIND_SEMAPHORE: LockKind

class AcquireRequest(_message.Message):
    __slots__ = ("open", "release")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    open: Open
    release: Release
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("queued", "acquired", "released", "lost")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    queued: Queued
    acquired: Acquired
    released: Released
    lost: Lost
    def __init__(self, queued: _Optional[_Union[Queued, _Mapping]] = ..., acquired: _Optional[_Union[Acquired, _Mapping]] = ..., released: _Optional[_Union[Released, _Mapping]] = ..., lost: _Optional[_Union[Lost, _Mapping]] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("name", "kind", "wait_timeout", "lease", "owner", "permits", "limit", "names", "redlock")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PERMITS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    REDLOCK_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: LockKind
    wait_timeout: _duration_pb2.Duration
    lease: _duration_pb2.Duration
    owner: str
    permits: int
    limit: int
    names: _containers.RepeatedScalarFieldContainer[str]
    redlock: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[LockKind, str]] = ..., wait_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., owner: _Optional[str] = ..., permits: _Optional[int] = ..., limit: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., redlock: bool = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Queued(_message.Message):
    __slots__ = ("position", "holder_ttl")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    HOLDER_TTL_FIELD_NUMBER: _ClassVar[int]
    position: int
    holder_ttl: _duration_pb2.Duration
    def __init__(self, position: _Optional[int] = ..., holder_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Acquired(_message.Message):
    __slots__ = ("fencing_token", "hold_count", "owner", "lease", "fencing_tokens", "waited")
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOLD_COUNT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITED_FIELD_NUMBER: _ClassVar[int]
    fencing_token: int
    hold_count: int
    owner: str
    lease: _duration_pb2.Duration
    fencing_tokens: _containers.RepeatedScalarFieldContainer[int]
    waited: _duration_pb2.Duration
    def __init__(self, fencing_token: _Optional[int] = ..., hold_count: _Optional[int] = ..., owner: _Optional[str] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., fencing_tokens: _Optional[_Iterable[int]] = ..., waited: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Released(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Lost(_message.Message):
    __slots__ = ("reason",)
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[Lost.Reason]
        LEASE_EXPIRED: _ClassVar[Lost.Reason]
        NOT_HELD: _ClassVar[Lost.Reason]
        FORCE_RELEASED: _ClassVar[Lost.Reason]
        SHUTDOWN: _ClassVar[Lost.Reason]
    REASON_UNSPECIFIED: Lost.Reason
    LEASE_EXPIRED: Lost.Reason
    NOT_HELD: Lost.Reason
    FORCE_RELEASED: Lost.Reason
    SHUTDOWN: Lost.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: Lost.Reason
    def __init__(self, reason: _Optional[_Union[Lost.Reason, str]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("prefix", "page_size", "page_token")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    page_size: int
    page_token: str
    def __init__(self, prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("locks", "next_page_token")
    LOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    locks: _containers.RepeatedCompositeFieldContainer[LockState]
    next_page_token: str
    def __init__(self, locks: _Optional[_Iterable[_Union[LockState, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ForceReleaseRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ForceReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class LockState(_message.Message):
    __slots__ = ("name", "kind", "locked", "holders", "waiters", "last_fencing_token", "ttl")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LOCKED_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    LAST_FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: LockKind
    locked: bool
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    waiters: _containers.RepeatedCompositeFieldContainer[Waiter]
    last_fencing_token: int
    ttl: _duration_pb2.Duration
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[LockKind, str]] = ..., locked: bool = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., waiters: _Optional[_Iterable[_Union[Waiter, _Mapping]]] = ..., last_fencing_token: _Optional[int] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("owner", "hold_count", "ttl")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    HOLD_COUNT_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    owner: str
    hold_count: int
    ttl: _duration_pb2.Duration
    def __init__(self, owner: _Optional[str] = ..., hold_count: _Optional[int] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Waiter(_message.Message):
    __slots__ = ("owner", "position")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    owner: str
    position: int
    def __init__(self, owner: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...
