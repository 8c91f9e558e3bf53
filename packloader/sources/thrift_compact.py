"""A reader of Thrift's compact protocol, the encoding of Parquet's page headers: pyarrow decodes pages only a
column chunk at a time, so reading one document's pages means parsing their headers here. Structs come back as
{field id: value}; unknown fields are skipped, so newer writers' extra fields do no harm."""

from __future__ import annotations


class ThriftError(ValueError):
    """Bytes that are not a well-formed compact-protocol struct (or end too soon)."""


def read_varint(data, pos: int) -> tuple[int, int]:
    """A base-128 varint at data[pos] and the position after it: Thrift's integers and Parquet's level-run headers
    are both written this way."""
    shift = out = 0
    while True:
        if pos >= len(data):
            raise ThriftError("the bytes end inside a varint")
        b = data[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7
        if shift > 70:
            raise ThriftError("a varint longer than 10 bytes")


class _Reader:
    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise ThriftError("the bytes end inside a struct")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        out, self.pos = read_varint(self.data, self.pos)
        return out

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int, depth: int):
        if depth > 32:
            raise ThriftError("structs nested too deep")
        if kind in (1, 2):  # booleans in a struct field header carry their value in the type
            return kind == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            self.pos += 8
            return None
        if kind == 8:
            n = self.varint()
            out = self.data[self.pos:self.pos + n]
            if len(out) != n:
                raise ThriftError("the bytes end inside a binary field")
            self.pos += n
            return out
        if kind in (9, 10):
            head = self.byte()
            n, elem = head >> 4, head & 0x0F
            if n == 15:
                n = self.varint()
            return [self.byte() == 1 if elem in (1, 2) else self.value(elem, depth + 1) for _ in range(n)]
        if kind == 11:
            n = self.varint()
            if not n:
                return {}
            types = self.byte()
            return {self.value(types >> 4, depth + 1): self.value(types & 0x0F, depth + 1) for _ in range(n)}
        if kind == 12:
            return self.struct(depth + 1)
        raise ThriftError(f"unknown compact type {kind}")

    def struct(self, depth: int = 0) -> dict:
        out: dict = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return out
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self.zigzag()
            out[last] = self.value(kind, depth)


def read_struct(data: bytes, pos: int = 0) -> tuple[dict, int]:
    """The struct encoded at `data[pos:]` and the position just after it."""
    r = _Reader(data, pos)
    try:
        out = r.struct()
    except IndexError as e:
        raise ThriftError(str(e)) from None
    return out, r.pos
