"""The shared libraries an ELF file needs (its DT_NEEDED entries), read in pure Python (no readelf).

The build uses it to refuse an extension that carries its own copy of the C++ runtime: a compiler that
links libstdc++ statically puts a second libstdc++ beside torch's in the process, and that copy crashed
formatting an integer in a TORCH_CHECK message (seen with a GPU image's CXX=/opt/gcc/bin/g++). torch's
libraries need libstdc++.so.6; so must fastformer._C.

ELF64 little-endian (x86-64, aarch64): the section headers give the SHT_DYNAMIC section, whose entries
are (d_tag, d_val) pairs; DT_NEEDED values are offsets into the string table its sh_link names.
"""
from __future__ import annotations

import struct

SHT_DYNAMIC, DT_NULL, DT_NEEDED = 6, 0, 1


def needed_libraries(path: str) -> list[str]:
    """DT_NEEDED of an ELF64 little-endian shared object, in order; ValueError for anything else."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != SHT_DYNAMIC:
            continue
        strtab_offset = sections[link][4]
        names = []
        for entry in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, entry)
            if tag == DT_NULL:
                break
            if tag == DT_NEEDED:
                end = data.index(b"\0", strtab_offset + value)
                names.append(data[strtab_offset + value:end].decode())
        return names
    return []  # statically linked: no dynamic section


def links_libstdcxx_dynamically(path: str) -> bool:
    return any(name.startswith("libstdc++.so") for name in needed_libraries(path))
