"""Writes a minimal proxy-wasm module: the stand-in for the kvaffine filter when the
manifests are rendered and Envoy validates them without a built filter.

It exports what Envoy's Wasm host requires (memory, _initialize, the ABI version marker,
proxy_on_memory_allocate) and accepts every VM start and configuration, so Envoy can create
the VM and check everything around it. It is a few hundred bytes of hand-assembled Wasm.

usage: stub_wasm.py OUT
"""

import sys

I32 = 0x7F


def leb128(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def vec(items):
    return leb128(len(items)) + b"".join(items)


def name(text):
    raw = text.encode()
    return leb128(len(raw)) + raw


def section(section_id, body):
    return bytes([section_id]) + leb128(len(body)) + body


def module():
    # Function types: () -> (), (i32) -> i32, (i32, i32) -> (), (i32, i32) -> i32, (i32) -> ().
    types = [
        bytes([0x60, 0, 0]),
        bytes([0x60, 1, I32, 1, I32]),
        bytes([0x60, 2, I32, I32, 0]),
        bytes([0x60, 2, I32, I32, 1, I32]),
        bytes([0x60, 1, I32, 0]),
    ]
    # (type, body): nop; return 1024 (a fixed scratch address); nop; return 1 (true); nop.
    functions = [
        (0, b"\x0b"),
        (1, b"\x41\x80\x08\x0b"),
        (2, b"\x0b"),
        (3, b"\x41\x01\x0b"),
        (4, b"\x0b"),
    ]
    func, memory = 0, 2
    exports = [
        ("memory", memory, 0),
        ("_initialize", func, 0),
        ("proxy_abi_version_0_2_1", func, 0),
        ("proxy_on_memory_allocate", func, 1),
        ("proxy_on_context_create", func, 2),
        ("proxy_on_vm_start", func, 3),
        ("proxy_on_configure", func, 3),
        ("proxy_on_done", func, 1),
        ("proxy_on_delete", func, 4),
    ]
    out = b"\0asm" + bytes([1, 0, 0, 0])
    out += section(1, vec(types))
    out += section(3, vec([leb128(t) for t, _ in functions]))
    out += section(5, vec([bytes([0]) + leb128(2)]))  # one memory of 2 pages
    out += section(7, vec([name(n) + bytes([kind]) + leb128(i) for n, kind, i in exports]))
    out += section(10, vec([leb128(len(b"\0" + body)) + b"\0" + body for _, body in functions]))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1], "wb") as f:
        f.write(module())
