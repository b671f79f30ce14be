"""Damage to a file on disk, as the checkpoint tests inflict it: bytes flipped (XOR 0xFF) at one of four places."""

from __future__ import annotations

# place -> (offset, length) for a file of n bytes; offsets are clamped into the file
PLACES = {"start": lambda n: (0, 1), "middle": lambda n: (n // 2, 1), "end": lambda n: (n - 1, 1),
          "run256": lambda n: (n // 2 - 128, 256)}


def flip(path, place: str) -> None:
    """Flip the bytes of ``path`` (a ``pathlib.Path``) at ``place`` (a key of :data:`PLACES`)."""
    data = bytearray(path.read_bytes())
    offset, length = PLACES[place](len(data))
    offset = min(max(offset, 0), max(len(data) - length, 0))
    data[offset:offset + length] = bytes(b ^ 0xFF for b in data[offset:offset + length])
    path.write_bytes(bytes(data))
