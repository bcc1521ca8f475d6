"""Mark shared libraries' need of the GLIBC_2.38 symbol version weak (VER_FLG_WEAK), in place.

The llama-cpp-py-sync wheel's libraries are built against glibc 2.38 and need it only for four C23 functions
(``__isoc23_strtol`` and kin). On an older glibc the loader refuses them for the missing version; with the
need marked weak it loads them, and ``isoc23.c`` (preloaded) supplies those four functions. Used by
bench/llama_cpp/setup.sh on the wheel installed for the benchmark only, never on dofla's own files.

    python bench/llama_cpp/weak_glibc_2_38.py LIB.so [LIB.so ...]
"""

from __future__ import annotations

import struct
import sys

SHT_GNU_VERNEED = 0x6FFFFFFE
VER_FLG_WEAK = 0x2


def _version_needs(data: bytes | bytearray):
    """(offset of the entry's flags, version name, flags) of every version an ELF file needs."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)
    ]
    for _, kind, _, _, offset, _, link, needs, _, _ in sections:
        if kind != SHT_GNU_VERNEED:
            continue
        strings = sections[link][4]
        need = offset
        for _ in range(needs):
            _, aux_count, _, aux_offset, next_need = struct.unpack_from("<HHIII", data, need)
            aux = need + aux_offset
            for _ in range(aux_count):
                _, flags, _, name, next_aux = struct.unpack_from("<IHHII", data, aux)
                end = data.index(b"\0", strings + name)
                yield aux + 4, bytes(data[strings + name : end]).decode(), flags
                aux += next_aux
            need += next_need


def version_needs(path: str) -> list[tuple[str, int]]:
    """(version name, flags) of every symbol version the ELF file ``path`` needs."""
    with open(path, "rb") as handle:
        return [(name, flags) for _, name, flags in _version_needs(handle.read())]


def mark_weak(path: str, version: str = "GLIBC_2.38") -> int:
    """Set VER_FLG_WEAK on every need of ``version`` in ``path``; returns how many."""
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    marked = 0
    for flags_at, name, flags in list(_version_needs(data)):
        if name == version:
            struct.pack_into("<H", data, flags_at, flags | VER_FLG_WEAK)
            marked += 1
    with open(path, "wb") as handle:
        handle.write(data)
    return marked


if __name__ == "__main__":
    for library in sys.argv[1:]:
        print(f"{library}: {mark_weak(library)} need(s) of GLIBC_2.38 marked weak")
