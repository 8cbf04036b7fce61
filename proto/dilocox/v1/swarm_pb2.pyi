from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ContributionRequest(_message.Message):
    __slots__ = ("key", "owner", "upload", "commitment")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    key: str
    owner: str
    upload: bytes
    commitment: str
    def __init__(self, key: _Optional[str] = ..., owner: _Optional[str] = ..., upload: _Optional[bytes] = ..., commitment: _Optional[str] = ...) -> None: ...

class ContributionChunk(_message.Message):
    __slots__ = ("data", "error", "total_bytes")
    DATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    error: str
    total_bytes: int
    def __init__(self, data: _Optional[bytes] = ..., error: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...
