from dflash_serve.services.api.dflash.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputsVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUTS_VERSION_UNSPECIFIED: _ClassVar[OutputsVersion]
    OUTPUTS_VERSION_1: _ClassVar[OutputsVersion]

class IntakeVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INTAKE_VERSION_UNSPECIFIED: _ClassVar[IntakeVersion]
    INTAKE_VERSION_1: _ClassVar[IntakeVersion]
OUTPUTS_VERSION_UNSPECIFIED: OutputsVersion
OUTPUTS_VERSION_1: OutputsVersion
INTAKE_VERSION_UNSPECIFIED: IntakeVersion
INTAKE_VERSION_1: IntakeVersion

class OutputsHello(_message.Message):
    __slots__ = ("version", "token", "stream_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    version: OutputsVersion
    token: bytes
    stream_id: str
    def __init__(self, version: _Optional[_Union[OutputsVersion, str]] = ..., token: _Optional[bytes] = ..., stream_id: _Optional[str] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "num_prompt_tokens", "num_output_tokens", "spec_stats", "error", "refused")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_STATS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _generation_pb2.FinishReason
    num_prompt_tokens: int
    num_output_tokens: int
    spec_stats: _generation_pb2.SpecStats
    error: str
    refused: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., spec_stats: _Optional[_Union[_generation_pb2.SpecStats, _Mapping]] = ..., error: _Optional[str] = ..., refused: bool = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    def __init__(self, outputs: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ...) -> None: ...

class IntakeHello(_message.Message):
    __slots__ = ("version", "token")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    version: IntakeVersion
    token: bytes
    def __init__(self, version: _Optional[_Union[IntakeVersion, str]] = ..., token: _Optional[bytes] = ...) -> None: ...

class ResolvedSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "num_speculative_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    num_speculative_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ResolvedSampling
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ...) -> None: ...

class IntakeMessages(_message.Message):
    __slots__ = ("adds", "cancels")
    ADDS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    adds: _containers.RepeatedCompositeFieldContainer[AddRequest]
    cancels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adds: _Optional[_Iterable[_Union[AddRequest, _Mapping]]] = ..., cancels: _Optional[_Iterable[str]] = ...) -> None: ...
