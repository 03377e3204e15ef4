from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileRequest(_message.Message):
    __slots__ = ("seconds", "fan_out", "no_stack")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAN_OUT_FIELD_NUMBER: _ClassVar[int]
    NO_STACK_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    fan_out: bool
    no_stack: bool
    def __init__(self, seconds: _Optional[float] = ..., fan_out: _Optional[bool] = ..., no_stack: _Optional[bool] = ...) -> None: ...

class ProcessTrace(_message.Message):
    __slots__ = ("role", "process_id", "trace_gzip", "activity", "clock_offset_ns", "clock_rtt_ns", "error")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_GZIP_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_NS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_RTT_NS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    role: str
    process_id: str
    trace_gzip: bytes
    activity: int
    clock_offset_ns: int
    clock_rtt_ns: int
    error: str
    def __init__(self, role: _Optional[str] = ..., process_id: _Optional[str] = ..., trace_gzip: _Optional[bytes] = ..., activity: _Optional[int] = ..., clock_offset_ns: _Optional[int] = ..., clock_rtt_ns: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("traces",)
    TRACES_FIELD_NUMBER: _ClassVar[int]
    traces: _containers.RepeatedCompositeFieldContainer[ProcessTrace]
    def __init__(self, traces: _Optional[_Iterable[_Union[ProcessTrace, _Mapping]]] = ...) -> None: ...

class ClockRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClockResponse(_message.Message):
    __slots__ = ("wall_ns",)
    WALL_NS_FIELD_NUMBER: _ClassVar[int]
    wall_ns: int
    def __init__(self, wall_ns: _Optional[int] = ...) -> None: ...
