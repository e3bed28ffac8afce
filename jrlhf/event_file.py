"""TensorBoard event files, written and read without TensorFlow, tensorboardX or protobuf.

An event file is a sequence of TFRecords (little-endian uint64 length, masked CRC-32C of those 8
bytes, the data, masked CRC-32C of the data), each holding one serialized ``tensorflow.Event``.
jrlhf writes two kinds: the ``file_version`` header TensorBoard expects first, and one scalar
summary per event (``Summary.Value.simple_value``). The few protobuf fields involved are encoded
here by hand: tensorboardX, the usual writer, imports torch whenever torch is installed (over two
seconds at the start of every training process), and the trainer needs nothing else from it.

Field numbers (tensorflow/core/util/event.proto, summary.proto)::

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }
"""

from __future__ import annotations

import math
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

FILE_VERSION = "brain.Event:2"

# Protobuf wire types.
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    crc = 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The rotated-and-offset CRC-32C TFRecord framing stores (so a CRC of CRCs is not trivial)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """``data`` as one TFRecord."""
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64s as ten bytes, as protobuf does
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, _LENGTH) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    return (
        _key(1, _FIXED64) + struct.pack("<d", wall_time) + _key(2, _VARINT) + _varint(step) + body
    )


def version_event(wall_time: float) -> bytes:
    """The serialized header event (step 0, ``file_version``)."""
    return _event(wall_time, 0, _length_delimited(3, FILE_VERSION.encode()))


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # beyond float32's range: infinite, as protobuf stores it
        return struct.pack("<f", math.copysign(math.inf, value))


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """One serialized Event holding the scalar ``tag = value`` at ``step`` (a float32, as
    TensorBoard stores scalars: values beyond its range become infinite; non-finite values are
    kept as they are)."""
    entry = _length_delimited(1, tag.encode()) + _key(2, _FIXED32) + _float32(value)
    return _event(wall_time, step, _length_delimited(5, _length_delimited(1, entry)))


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of a serialized message's top-level fields: ints for
    varints and fixed-width fields (their raw bits), bytes for length-delimited ones."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _read_varint(data, pos)
        elif wire == _FIXED64:
            value, pos = int.from_bytes(data[pos : pos + 8], "little"), pos + 8
        elif wire == _FIXED32:
            value, pos = int.from_bytes(data[pos : pos + 4], "little"), pos + 4
        elif wire == _LENGTH:
            n, pos = _read_varint(data, pos)
            value, pos = data[pos : pos + n], pos + n
        else:
            raise ValueError(f"protobuf wire type {wire} (field {field}) is not one events use")
        if pos > len(data):
            raise ValueError("truncated protobuf message")
        yield field, wire, value


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated protobuf varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


class Event:
    """The fields of a parsed Event that jrlhf reads: ``step``, whether it is the
    ``file_version`` header, and its scalars as ``{tag: value}``."""

    __slots__ = ("is_header", "scalars", "step")

    # A field whose wire type is not the schema's is skipped, as protobuf keeps it as unknown.
    def __init__(self, data: bytes):
        self.step, self.is_header, self.scalars = 0, False, {}
        for field, wire, value in _fields(data):
            if (field, wire) == (2, _VARINT):
                self.step = value - (1 << 64) if value >= 1 << 63 else value
            elif (field, wire) == (3, _LENGTH):
                self.is_header = True
            elif (field, wire) == (5, _LENGTH):
                for f, w, entry in _fields(value):
                    if (f, w) == (1, _LENGTH):
                        self._add_scalar(entry)

    def _add_scalar(self, entry: bytes) -> None:
        tag, simple = None, None
        for field, wire, value in _fields(entry):
            if (field, wire) == (1, _LENGTH):
                tag = value.decode()
            elif (field, wire) == (2, _FIXED32):
                (simple,) = struct.unpack("<f", value.to_bytes(4, "little"))
        if tag is not None and simple is not None:
            self.scalars[tag] = simple


def read_records(path: str | Path) -> Iterator[tuple[bytes, Event]]:
    """The framed records of an event file (the raw bytes, the parsed event); stops at a torn or
    corrupt tail, which a run killed mid-write leaves."""
    buf = Path(path).read_bytes()
    pos = 0
    while pos + 12 <= len(buf):
        header = buf[pos : pos + 8]
        (n,) = struct.unpack("<Q", header)
        end = pos + 12 + n + 4
        if end > len(buf) or struct.unpack("<I", buf[pos + 8 : pos + 12])[0] != masked_crc32c(
            header
        ):
            return
        data = buf[pos + 12 : pos + 12 + n]
        if struct.unpack("<I", buf[end - 4 : end])[0] != masked_crc32c(data):
            return
        try:
            event = Event(data)
        except ValueError:
            return
        yield buf[pos:end], event
        pos = end


class EventFileWriter:
    """Appends scalar events to a new event file in ``log_dir``, named as TensorBoard looks for
    (``events.out.tfevents.<seconds>.<host><suffix>``); the header is written at creation."""

    def __init__(self, log_dir: str | Path, filename_suffix: str = ""):
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}{filename_suffix}"
        self.path = log_dir / name
        self._file = open(self.path, "ab")  # noqa: SIM115 (closed in close())
        self._file.write(frame(version_event(now)))
        self._file.flush()

    def add_scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One event per scalar, all at ``step``; flushed, so a killed run keeps them."""
        now = time.time()
        self._file.write(b"".join(frame(scalar_event(k, v, step, now)) for k, v in values.items()))
        self._file.flush()

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if not self._file.closed:
            self._file.close()
