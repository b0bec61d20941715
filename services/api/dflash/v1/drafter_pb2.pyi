from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_2: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_3: _ClassVar[ProtocolVersion]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
PROTOCOL_VERSION_2: ProtocolVersion
PROTOCOL_VERSION_3: ProtocolVersion

class SharedBuffer(_message.Message):
    __slots__ = ("buffer_id", "shm_name", "cuda_ipc_handle", "storage_offset", "shape", "dtype", "device")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    shm_name: str
    cuda_ipc_handle: bytes
    storage_offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: int
    def __init__(self, buffer_id: _Optional[str] = ..., shm_name: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., storage_offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[int] = ...) -> None: ...

class KVBlockHandle(_message.Message):
    __slots__ = ("buffer_id", "row_offset", "rows")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    row_offset: int
    rows: int
    def __init__(self, buffer_id: _Optional[str] = ..., row_offset: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "features", "kv_block_size", "num_kv_blocks", "block_size", "embedding", "lm_head", "embedding_scale", "final_logit_softcapping", "graph_batch_sizes", "max_blocks_per_sequence", "scratch_blocks", "chained_inputs", "writes_done_event", "drafts", "group1_writes_done_event")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    LM_HEAD_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SCALE_FIELD_NUMBER: _ClassVar[int]
    FINAL_LOGIT_SOFTCAPPING_FIELD_NUMBER: _ClassVar[int]
    GRAPH_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHAINED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    WRITES_DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    GROUP1_WRITES_DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    features: SharedBuffer
    kv_block_size: int
    num_kv_blocks: int
    block_size: int
    embedding: SharedBuffer
    lm_head: SharedBuffer
    embedding_scale: float
    final_logit_softcapping: float
    graph_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    max_blocks_per_sequence: int
    scratch_blocks: _containers.RepeatedScalarFieldContainer[int]
    chained_inputs: SharedBuffer
    writes_done_event: bytes
    drafts: SharedBuffer
    group1_writes_done_event: bytes
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., features: _Optional[_Union[SharedBuffer, _Mapping]] = ..., kv_block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., embedding: _Optional[_Union[SharedBuffer, _Mapping]] = ..., lm_head: _Optional[_Union[SharedBuffer, _Mapping]] = ..., embedding_scale: _Optional[float] = ..., final_logit_softcapping: _Optional[float] = ..., graph_batch_sizes: _Optional[_Iterable[int]] = ..., max_blocks_per_sequence: _Optional[int] = ..., scratch_blocks: _Optional[_Iterable[int]] = ..., chained_inputs: _Optional[_Union[SharedBuffer, _Mapping]] = ..., writes_done_event: _Optional[bytes] = ..., drafts: _Optional[_Union[SharedBuffer, _Mapping]] = ..., group1_writes_done_event: _Optional[bytes] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("protocol_version", "error", "drafter", "block_size", "drafts_done_event", "group1_drafts_done_event")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    GROUP1_DRAFTS_DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    error: str
    drafter: str
    block_size: int
    drafts_done_event: bytes
    group1_drafts_done_event: bytes
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., error: _Optional[str] = ..., drafter: _Optional[str] = ..., block_size: _Optional[int] = ..., drafts_done_event: _Optional[bytes] = ..., group1_drafts_done_event: _Optional[bytes] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("protocol_version", "step", "features", "positions", "slots", "request_ids", "bonus_tokens", "starts", "block_tables", "chained", "group", "first_row")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    CHAINED_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    step: int
    features: KVBlockHandle
    positions: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    bonus_tokens: _containers.RepeatedScalarFieldContainer[int]
    starts: _containers.RepeatedScalarFieldContainer[int]
    block_tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    chained: bool
    group: int
    first_row: int
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., step: _Optional[int] = ..., features: _Optional[_Union[KVBlockHandle, _Mapping]] = ..., positions: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., request_ids: _Optional[_Iterable[str]] = ..., bonus_tokens: _Optional[_Iterable[int]] = ..., starts: _Optional[_Iterable[int]] = ..., block_tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., chained: bool = ..., group: _Optional[int] = ..., first_row: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("protocol_version", "step", "num_sequences", "error", "draft_seconds", "wait_seconds")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    step: int
    num_sequences: int
    error: str
    draft_seconds: float
    wait_seconds: float
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., step: _Optional[int] = ..., num_sequences: _Optional[int] = ..., error: _Optional[str] = ..., draft_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class ReleaseSequences(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DrafterRequest(_message.Message):
    __slots__ = ("hello", "step", "release")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    step: StepRequest
    release: ReleaseSequences
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., step: _Optional[_Union[StepRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseSequences, _Mapping]] = ...) -> None: ...

class DrafterReply(_message.Message):
    __slots__ = ("hello", "step")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    hello: HelloReply
    step: StepResult
    def __init__(self, hello: _Optional[_Union[HelloReply, _Mapping]] = ..., step: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...
