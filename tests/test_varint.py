"""The one base-128 varint reader that Thrift headers and Parquet level runs share, against hand-worked bytes."""

import pytest

from packloader.sources.parquet_pages import PageError, varint
from packloader.sources.thrift_compact import ThriftError, read_varint


@pytest.mark.parametrize(("data", "value", "end"), [
    (b"\x00", 0, 1),
    (b"\x7f", 127, 1),
    (b"\xac\x02", 300, 2),  # 300 = 0b10_0101100: low 7 bits 0x2c with the continuation bit, then 2
    (b"\xff\xff\xff\xff\x0f\x99", 2**32 - 1, 5),
])
def test_read_varint(data: bytes, value: int, end: int) -> None:
    assert read_varint(data, 0) == (value, end)
    assert varint(b"\x01" + data, 1) == (value, end + 1)


def test_cut_short() -> None:
    with pytest.raises(ThriftError, match="end inside a varint"):
        read_varint(b"\xac", 0)
    with pytest.raises(PageError, match="level run's header at byte 0"):
        varint(b"\xac", 0)
    with pytest.raises(ThriftError, match="longer than 10 bytes"):
        read_varint(b"\x80" * 11 + b"\x01", 0)
