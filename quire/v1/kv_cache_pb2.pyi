from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "extra_keys", "lora_name", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    lora_name: str
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., extra_keys: _Optional[_Iterable[str]] = ..., lora_name: _Optional[str] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ("medium",)
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    medium: str
    def __init__(self, medium: _Optional[str] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "timestamp_s", "events")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    timestamp_s: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, seq: _Optional[int] = ..., timestamp_s: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class KVCacheSnapshot(_message.Message):
    __slots__ = ("seq", "block_hashes", "incarnation_id")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    incarnation_id: str
    def __init__(self, seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., incarnation_id: _Optional[str] = ...) -> None: ...
