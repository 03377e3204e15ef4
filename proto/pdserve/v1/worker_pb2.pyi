from proto.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "priority", "deadline", "results_to", "choices", "choice_ids", "choice_results_to")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    RESULTS_TO_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    CHOICE_IDS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_RESULTS_TO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    deadline: float
    results_to: str
    choices: int
    choice_ids: _containers.RepeatedScalarFieldContainer[str]
    choice_results_to: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., deadline: _Optional[float] = ..., results_to: _Optional[str] = ..., choices: _Optional[int] = ..., choice_ids: _Optional[_Iterable[str]] = ..., choice_results_to: _Optional[_Iterable[str]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request", "transfer_timeout_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    transfer_timeout_s: float
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., transfer_timeout_s: _Optional[float] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("descriptor", "num_blocks")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    descriptor: bytes
    num_blocks: int
    def __init__(self, descriptor: _Optional[bytes] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "local_prefill")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    local_prefill: bool
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class TokenChunkOrFinish(_message.Message):
    __slots__ = ("chunk", "finish", "index")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TokenChunk
    finish: _common_pb2.Finish
    index: int
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TokenChunk, _Mapping]] = ..., finish: _Optional[_Union[_common_pb2.Finish, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "descriptor", "fetch")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    descriptor: bytes
    fetch: FetchSource
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., descriptor: _Optional[bytes] = ..., fetch: _Optional[_Union[FetchSource, _Mapping]] = ...) -> None: ...

class FetchSource(_message.Message):
    __slots__ = ("address", "num_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    num_blocks: int
    def __init__(self, address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("fetch_id", "token_ids", "descriptor")
    FETCH_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    fetch_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    descriptor: bytes
    def __init__(self, fetch_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., descriptor: _Optional[bytes] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("num_blocks", "cached_tokens")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    cached_tokens: int
    def __init__(self, num_blocks: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "cached_tokens", "transfer_bytes", "prefill_ms")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    cached_tokens: int
    transfer_bytes: int
    prefill_ms: float
    def __init__(self, first_token_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., prefill_ms: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "queued_prefill_tokens", "kv_blocks_total", "kv_blocks_used", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "draining")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    draining: bool
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...
