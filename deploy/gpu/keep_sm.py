"""Blank the GPU machine code built for other GPUs in a shared library's fatbins (GPU bundle).

vLLM's kernel libraries carry one cubin per compute capability (7.5 … 12.0) plus PTX.
A GPU loads only the cubin of its own major version (SASS runs within one major
version) and JIT-compiles PTX only for code that has no such cubin, so in a bundle for
one GPU kind the cubins of the other majors are dead weight, and so is the PTX of every
fatbin (one per compiled source file) that holds a cubin of the kept major. Their payload
bytes are zeroed in place (headers, sizes and offsets stay, so the file's layout is
unchanged; zeros compress to nothing); PTX of fatbins without such a cubin is kept.
See docs/ARCHITECTURE.md, "GPU bundle".

  python3 deploy/gpu/keep_sm.py 90 LIB.so [LIB.so ...]
"""

from __future__ import annotations

import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
KIND_ELF = 2  # a cubin; kind 1 is PTX
SECTION = b".nv_fatbin"


def fatbin_section(data: bytes) -> tuple[int, int]:
    """File offset and size of the ELF64 section `.nv_fatbin`."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def header(i: int) -> tuple[int, int, int]:
        name, _t, _f, _a, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, off, size
    _, strtab, _ = header(shstrndx)
    for i in range(shnum):
        name, off, size = header(i)
        if data[strtab + name: strtab + name + len(SECTION) + 1] == SECTION + b"\0":
            return off, size
    raise ValueError("no .nv_fatbin section")


def fatbin_entries(buf: bytearray, pos: int, end: int) -> list[tuple[int, int, int, int]]:
    """(kind, compute capability, payload offset, padded size) of one fatbin's entries."""
    entries = []
    while pos < end:
        kind, _v, entry_head, padded = struct.unpack_from("<HHIQ", buf, pos)
        sm, = struct.unpack_from("<I", buf, pos + 28)
        entries.append((kind, sm, pos + entry_head, padded))
        pos += entry_head + padded
    return entries


def blank_other_majors(buf: bytearray, keep_major: int) -> dict[str, int]:
    """Zero the cubins of other majors, and PTX where a cubin of keep_major exists."""
    off, size = fatbin_section(bytes(buf))
    pos, end_of_section = off, off + size
    kept = blanked = 0
    while pos + 16 <= end_of_section:
        magic, _ver, head, fat_size = struct.unpack_from("<IHHQ", buf, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fatbins are 8-byte aligned, padding between them
            continue
        entries = fatbin_entries(buf, pos + head, pos + head + fat_size)
        has_cubin = any(kind == KIND_ELF and sm // 10 == keep_major for kind, sm, _, _ in entries)
        for kind, sm, payload, padded in entries:
            if (kind == KIND_ELF and sm // 10 != keep_major) or (kind != KIND_ELF and has_cubin):
                buf[payload: payload + padded] = bytes(padded)
                blanked += padded
            else:
                kept += padded
        pos += head + fat_size
    return {"kept_bytes": kept, "blanked_bytes": blanked}


def main(argv: list[str]) -> None:
    keep_major = int(argv[1]) // 10
    for path in argv[2:]:
        with open(path, "rb") as f:
            buf = bytearray(f.read())
        try:
            counts = blank_other_majors(buf, keep_major)
        except ValueError:
            continue  # no GPU code in it
        with open(path, "wb") as f:
            f.write(buf)
        print(f"{path}: {counts['blanked_bytes'] >> 20} MiB of other GPUs' cubins blanked, "
              f"{counts['kept_bytes'] >> 20} MiB kept")


if __name__ == "__main__":
    main(sys.argv)
