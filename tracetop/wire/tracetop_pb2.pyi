from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    RUN_START: _ClassVar[EventKind]
    STEP: _ClassVar[EventKind]
    COLLECTIVE: _ClassVar[EventKind]
    PIPE_INSTR: _ClassVar[EventKind]
    OFFLOAD: _ClassVar[EventKind]
    MEMORY: _ClassVar[EventKind]
    THROUGHPUT: _ClassVar[EventKind]
    GPU_SAMPLE: _ClassVar[EventKind]
    HOST_SAMPLE: _ClassVar[EventKind]
    HEARTBEAT: _ClassVar[EventKind]
    GAP: _ClassVar[EventKind]
    XID: _ClassVar[EventKind]
    CLOCK_OFFSET: _ClassVar[EventKind]
    GPU_PROCESS: _ClassVar[EventKind]

class CommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_KIND_UNSPECIFIED: _ClassVar[CommandKind]
    SET_MICRO_BATCH: _ClassVar[CommandKind]
    OFFLOAD_OPTIMIZER: _ClassVar[CommandKind]
    REBALANCE: _ClassVar[CommandKind]
    PROFILE: _ClassVar[CommandKind]

class CommandStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_STAGE_RESULT: _ClassVar[CommandStage]
    COMMAND_STAGE_RECEIVED: _ClassVar[CommandStage]
    COMMAND_STAGE_UNDONE: _ClassVar[CommandStage]
    COMMAND_STAGE_UNDO_FAILED: _ClassVar[CommandStage]

class ControlOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROL_OP_UNSPECIFIED: _ClassVar[ControlOp]
    PROPOSE: _ClassVar[ControlOp]
    APPROVE: _ClassVar[ControlOp]
    REJECT: _ClassVar[ControlOp]
    ROLLBACK: _ClassVar[ControlOp]
EVENT_KIND_UNSPECIFIED: EventKind
RUN_START: EventKind
STEP: EventKind
COLLECTIVE: EventKind
PIPE_INSTR: EventKind
OFFLOAD: EventKind
MEMORY: EventKind
THROUGHPUT: EventKind
GPU_SAMPLE: EventKind
HOST_SAMPLE: EventKind
HEARTBEAT: EventKind
GAP: EventKind
XID: EventKind
CLOCK_OFFSET: EventKind
GPU_PROCESS: EventKind
COMMAND_KIND_UNSPECIFIED: CommandKind
SET_MICRO_BATCH: CommandKind
OFFLOAD_OPTIMIZER: CommandKind
REBALANCE: CommandKind
PROFILE: CommandKind
COMMAND_STAGE_RESULT: CommandStage
COMMAND_STAGE_RECEIVED: CommandStage
COMMAND_STAGE_UNDONE: CommandStage
COMMAND_STAGE_UNDO_FAILED: CommandStage
CONTROL_OP_UNSPECIFIED: ControlOp
PROPOSE: ControlOp
APPROVE: ControlOp
REJECT: ControlOp
ROLLBACK: ControlOp

class Column(_message.Message):
    __slots__ = ("name", "data", "dictionary")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DICTIONARY_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    dictionary: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ..., dictionary: _Optional[_Iterable[str]] = ...) -> None: ...

class ColumnBatch(_message.Message):
    __slots__ = ("schema_version", "source_id", "seq", "run_id", "kind", "n", "columns", "crc32c", "first_record_ns", "sealed_ns", "epoch")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    FIRST_RECORD_NS_FIELD_NUMBER: _ClassVar[int]
    SEALED_NS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    source_id: str
    seq: int
    run_id: str
    kind: EventKind
    n: int
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    crc32c: int
    first_record_ns: int
    sealed_ns: int
    epoch: int
    def __init__(self, schema_version: _Optional[int] = ..., source_id: _Optional[str] = ..., seq: _Optional[int] = ..., run_id: _Optional[str] = ..., kind: _Optional[_Union[EventKind, str]] = ..., n: _Optional[int] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., crc32c: _Optional[int] = ..., first_record_ns: _Optional[int] = ..., sealed_ns: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("source_id", "seq", "epoch")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    seq: int
    epoch: int
    def __init__(self, source_id: _Optional[str] = ..., seq: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, batches: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("acks", "ship_interval_s", "end_code", "end_message", "end_metadata", "commands_waiting")
    class EndMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ACKS_FIELD_NUMBER: _ClassVar[int]
    SHIP_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    END_CODE_FIELD_NUMBER: _ClassVar[int]
    END_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_METADATA_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_WAITING_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[Ack]
    ship_interval_s: float
    end_code: str
    end_message: str
    end_metadata: _containers.ScalarMap[str, str]
    commands_waiting: bool
    def __init__(self, acks: _Optional[_Iterable[_Union[Ack, _Mapping]]] = ..., ship_interval_s: _Optional[float] = ..., end_code: _Optional[str] = ..., end_message: _Optional[str] = ..., end_metadata: _Optional[_Mapping[str, str]] = ..., commands_waiting: _Optional[bool] = ...) -> None: ...

class ClockRequest(_message.Message):
    __slots__ = ("client_send_ns",)
    CLIENT_SEND_NS_FIELD_NUMBER: _ClassVar[int]
    client_send_ns: int
    def __init__(self, client_send_ns: _Optional[int] = ...) -> None: ...

class ClockReply(_message.Message):
    __slots__ = ("client_send_ns", "server_recv_ns", "server_send_ns")
    CLIENT_SEND_NS_FIELD_NUMBER: _ClassVar[int]
    SERVER_RECV_NS_FIELD_NUMBER: _ClassVar[int]
    SERVER_SEND_NS_FIELD_NUMBER: _ClassVar[int]
    client_send_ns: int
    server_recv_ns: int
    server_send_ns: int
    def __init__(self, client_send_ns: _Optional[int] = ..., server_recv_ns: _Optional[int] = ..., server_send_ns: _Optional[int] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("command_id", "run_id", "kind", "int_value", "reason", "issued_ns", "expires_ns", "rollback_of", "values")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ISSUED_NS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_NS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_OF_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    run_id: str
    kind: CommandKind
    int_value: int
    reason: str
    issued_ns: int
    expires_ns: int
    rollback_of: str
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, command_id: _Optional[str] = ..., run_id: _Optional[str] = ..., kind: _Optional[_Union[CommandKind, str]] = ..., int_value: _Optional[int] = ..., reason: _Optional[str] = ..., issued_ns: _Optional[int] = ..., expires_ns: _Optional[int] = ..., rollback_of: _Optional[str] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("run_id", "rank", "source_key")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_KEY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    source_key: str
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., source_key: _Optional[str] = ...) -> None: ...

class CommandStatus(_message.Message):
    __slots__ = ("command_id", "run_id", "rank", "applied", "step", "message", "stage", "micro_batch", "micro_batches", "source_key")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_KEY_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    run_id: str
    rank: int
    applied: bool
    step: int
    message: str
    stage: CommandStage
    micro_batch: int
    micro_batches: int
    source_key: str
    def __init__(self, command_id: _Optional[str] = ..., run_id: _Optional[str] = ..., rank: _Optional[int] = ..., applied: _Optional[bool] = ..., step: _Optional[int] = ..., message: _Optional[str] = ..., stage: _Optional[_Union[CommandStage, str]] = ..., micro_batch: _Optional[int] = ..., micro_batches: _Optional[int] = ..., source_key: _Optional[str] = ...) -> None: ...

class StatusAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfileChunk(_message.Message):
    __slots__ = ("run_id", "rank", "source_key", "command_id", "offset", "data", "last", "total_bytes", "first_step", "steps", "start_ns", "end_ns", "note")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_KEY_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    source_key: str
    command_id: str
    offset: int
    data: bytes
    last: bool
    total_bytes: int
    first_step: int
    steps: int
    start_ns: int
    end_ns: int
    note: str
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., source_key: _Optional[str] = ..., command_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., total_bytes: _Optional[int] = ..., first_step: _Optional[int] = ..., steps: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class CommandBatch(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    def __init__(self, commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ...) -> None: ...

class ControlRequest(_message.Message):
    __slots__ = ("run_id", "op", "kind", "int_value", "action_id", "reason", "by", "approve", "rule", "expected", "values")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    ACTION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    APPROVE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    op: ControlOp
    kind: CommandKind
    int_value: int
    action_id: str
    reason: str
    by: str
    approve: bool
    rule: str
    expected: str
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_id: _Optional[str] = ..., op: _Optional[_Union[ControlOp, str]] = ..., kind: _Optional[_Union[CommandKind, str]] = ..., int_value: _Optional[int] = ..., action_id: _Optional[str] = ..., reason: _Optional[str] = ..., by: _Optional[str] = ..., approve: _Optional[bool] = ..., rule: _Optional[str] = ..., expected: _Optional[str] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class ControlReply(_message.Message):
    __slots__ = ("action_id", "state", "message")
    ACTION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    action_id: str
    state: str
    message: str
    def __init__(self, action_id: _Optional[str] = ..., state: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("sql", "max_rows")
    SQL_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    sql: str
    max_rows: int
    def __init__(self, sql: _Optional[str] = ..., max_rows: _Optional[int] = ...) -> None: ...

class QueryReply(_message.Message):
    __slots__ = ("arrow_ipc", "truncated")
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    truncated: bool
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., truncated: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("run_id", "interval_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    interval_s: float
    def __init__(self, run_id: _Optional[str] = ..., interval_s: _Optional[float] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("taken_ns", "arrow_ipc")
    TAKEN_NS_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    taken_ns: int
    arrow_ipc: bytes
    def __init__(self, taken_ns: _Optional[int] = ..., arrow_ipc: _Optional[bytes] = ...) -> None: ...
