"""The device code inside a shared library, read from its ELF `.nv_fatbin` section.

What `cuobjdump --list-elf --list-ptx` prints, without the CUDA toolkit: every fat binary in the
section is a header (magic 0xBA55ED50, header size, size of its entries) followed by entries, each
with a kind (1 = PTX, 2 = ELF cubin), its header and payload sizes, and the architecture number
(80 for sm_80 / compute_80). Arch-specific suffixes ("a", "f") live in flag bits not read here.
"""

from __future__ import annotations

import struct

_FATBIN_MAGIC = 0xBA55ED50
_KIND_PTX = 1
_KIND_ELF = 2


def _elf_section(path: str, wanted: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path} is not a 64-bit ELF file")
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size)
               for i in range(count)]
    names_header = headers[names_index]
    names = data[names_header[4]: names_header[4] + names_header[5]]
    for header in headers:
        name = names[header[0]: names.index(b"\0", header[0])].decode()
        if name == wanted:
            return data[header[4]: header[4] + header[5]]
    raise ValueError(f"{path} has no {wanted} section")


def device_code(path: str) -> list[str]:
    """Every entry of the library's fat binaries: "sm_N" (SASS) or "compute_N" (PTX)."""
    section = _elf_section(path, ".nv_fatbin")
    entries = []
    offset = 0
    while offset + 16 <= len(section):
        magic, _, header_size, entries_size = struct.unpack_from("<IHHQ", section, offset)
        if magic != _FATBIN_MAGIC:  # padding between fat binaries
            offset += 8
            continue
        entry = offset + header_size
        end = entry + entries_size
        while entry < end:
            kind, _, entry_header_size, padded_size = struct.unpack_from("<HHII", section, entry)
            (arch,) = struct.unpack_from("<I", section, entry + 0x1C)
            if kind == _KIND_ELF:
                entries.append(f"sm_{arch}")
            elif kind == _KIND_PTX:
                entries.append(f"compute_{arch}")
            entry += entry_header_size + padded_size
        offset = end
    return entries
