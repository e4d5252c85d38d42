"""Safetensors bytes, written from and read into memory we own.

Writing: a file's whole image (8-byte header length, JSON header, tensor data) is planned first (`plan_files`)
and lives in one pinned host buffer, so the device-to-host snapshot lands straight in the bytes that go to disk
and a write is a few large `write` calls, with no serializer copy in between.

Integrity is computed once: every tensor's XXH3-64 is taken from that buffer as it is written, and checked as the
bytes are read back (`read_files`), not in a separate pass over tens of GB. XXH3 (tens of GB/s a core) guards
against truncation, torn and corrupted files; it is not a signature: who may write the store is an access-control
question (IAM, POSIX permissions), not one a hash answers.

Reading: each file's wanted byte ranges are read into a small ring of pinned bounce buffers and copied to the
device asynchronously while the next chunk is read; files are read in parallel, one thread each. On the CPU, or
into host buffers the caller supplies (a serving replica's pinned staging), the bytes are read straight into the
destination. Tensors come back as views of one flat buffer per file, so
the model's fused experts ([E, 2I, h]) are views too when the file holds a layer's experts in order (ours do).

Layout rule: tensors of larger element size come first (8-byte header padding keeps every tensor aligned to its
element size), and a source tensor's pieces stay contiguous and in order.
"""
from __future__ import annotations

import bisect
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
               torch.int16: "I16", torch.int8: "I8", torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16",
               torch.uint8: "U8", torch.bool: "BOOL"}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
CHECKSUM = "xxh3_64"
CHUNK_BYTES = 64 << 20
# O_DIRECT reads move file offsets, lengths and buffer addresses in whole logical blocks: 4 KiB covers 512-byte
# and 4 KiB devices.
DIRECT_ALIGN = 4096


class IntegrityError(RuntimeError):
    """Bytes on disk that do not match what was written (size, header or a tensor's checksum)."""


class CheckpointFormatError(ValueError):
    """A well-formed file this reader does not support (a tensor dtype it has no torch type for)."""


def xxh3(data) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class Piece:
    """One named tensor of a file, `start`..`end` bytes into the file's data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Source:
    """A tensor we hold (e.g. fused experts [E, 2I, h]) and the named file tensors it is, in order and
    back to back (one expert's gate_proj, up_proj, the next expert's ...)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


@dataclass
class FileLayout:
    name: str
    header: bytes  # length prefix + padded JSON
    pieces: list[Piece]
    sources: dict[str, tuple[int, Source]] = field(default_factory=dict)  # key -> (first byte in the image, it)

    @property
    def data_bytes(self) -> int:
        return self.pieces[-1].end if self.pieces else 0

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_files(sources: Iterable[Source], name_of: Callable[[int, int], str], *, max_file_bytes: int,
               metadata: dict[str, str] | None = None) -> list[FileLayout]:
    """Pack `sources` (in their order) into files of at most `max_file_bytes` of data (a larger source gets a
    file of its own); `name_of(index, count)` names each file."""
    groups: list[list[Source]] = [[]]
    size = 0
    for source in sources:
        if groups[-1] and size + source.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(source)
        size += source.nbytes
    groups = [g for g in groups if g]
    return [_layout(name_of(i, len(groups)), group, metadata or {}) for i, group in enumerate(groups)]


def _layout(name: str, group: list[Source], metadata: dict[str, str]) -> FileLayout:
    ordered = sorted(group, key=lambda s: -_itemsize(s.dtype))  # stable: keeps the given order within a size
    pieces, starts, offset = [], {}, 0
    for source in ordered:
        starts[source.key] = offset
        step = _itemsize(source.dtype)
        for piece_name, shape in source.pieces:
            n = _numel(shape) * step
            pieces.append(Piece(piece_name, source.dtype, tuple(shape), offset, offset + n))
            offset += n
        if offset - starts[source.key] != source.nbytes:
            raise ValueError(f"{source.key}: its pieces hold {offset - starts[source.key]} bytes, the tensor "
                             f"{source.nbytes}")
    header = {"__metadata__": {"format": "pt", **metadata}}
    header.update({p.name: {"dtype": DTYPE_CODES[p.dtype], "shape": list(p.shape), "data_offsets": [p.start, p.end]}
                   for p in pieces})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # every tensor then starts aligned to its element size
    head = struct.pack("<Q", len(text)) + text
    return FileLayout(name, head, pieces, {s.key: (len(head) + starts[s.key], s) for s in ordered})


def fill(image: torch.Tensor, layout: FileLayout, state: dict[str, torch.Tensor], *, non_blocking: bool = False
         ) -> None:
    """Copy each source tensor of `layout` from `state` into the file image (uint8 [layout.size]), cast to its
    planned dtype where it is (on the GPU: half the bytes cross PCIe). From a GPU into pinned memory with
    `non_blocking`, the copies queue on the current stream (each cast's temporary is reused in stream order)."""
    for key, (start, source) in layout.sources.items():
        tensor = state[key].detach()
        if tensor.dtype != source.dtype:
            tensor = tensor.to(source.dtype)
        image[start:start + source.nbytes].view(source.dtype).view(source.shape).copy_(
            tensor, non_blocking=non_blocking)


def seal(image: memoryview, layout: FileLayout) -> dict:
    """Put the header into a planned file's image (header + data, e.g. a pinned buffer's bytes) and return its
    manifest facts: size, and the checksum of the header and of every tensor (taken from the image, once)."""
    if len(image) != layout.size:
        raise ValueError(f"{layout.name}: image holds {len(image)} bytes, the layout {layout.size}")
    image[:len(layout.header)] = layout.header
    head = len(layout.header)
    sums = {p.name: xxh3(image[head + p.start:head + p.end]) for p in layout.pieces}
    return {"bytes": layout.size, "data_bytes": layout.data_bytes, "header_" + CHECKSUM: xxh3(layout.header),
            CHECKSUM: sums}


def write_file(path: Path, image: memoryview, layout: FileLayout) -> dict:
    """Seal an image and write it to `path` in large writes, then fsync; returns its manifest facts."""
    facts = seal(image, layout)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, layout.size, CHUNK_BYTES):
            view = image[start:start + CHUNK_BYTES]
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return facts


def file_facts(path: Path) -> dict:
    """Manifest facts of a file someone else wrote: a safetensors file per tensor (as `write_file`), any other
    file as a whole. This reads the file once; our own writer never needs it."""
    data = path.read_bytes()
    if not path.name.endswith(".safetensors"):
        return {"bytes": len(data), CHECKSUM: xxh3(data)}
    head_len = 8 + struct.unpack("<Q", data[:8])[0]
    pieces = parse_header(data[:head_len], path)
    view = memoryview(data)
    return {"bytes": len(data), "data_bytes": len(data) - head_len, "header_" + CHECKSUM: xxh3(view[:head_len]),
            CHECKSUM: {p.name: xxh3(view[head_len + p.start:head_len + p.end]) for p in pieces}}


def parse_header(head: bytes, path: Path) -> list[Piece]:
    try:
        header = json.loads(head[8:])
        entries = {name: (v["dtype"], tuple(v["shape"]), *v["data_offsets"])
                   for name, v in header.items() if name != "__metadata__"}
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{path}: unreadable safetensors header ({exc})") from None
    for name, (code, *_) in entries.items():
        if code not in CODE_DTYPES:
            raise CheckpointFormatError(f"{path}: tensor {name}: dtype {code!r} is not supported; expected one of "
                                        f"{sorted(CODE_DTYPES)}")
    pieces = [Piece(name, CODE_DTYPES[code], shape, start, end) for name, (code, shape, start, end) in entries.items()]
    return sorted(pieces, key=lambda p: p.start)


def read_header(path: Path) -> tuple[bytes, list[Piece]]:
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise IntegrityError(f"{path}: {len(prefix)} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > 100 << 20:
            raise IntegrityError(f"{path}: header length {n} is not plausible")
        head = prefix + f.read(n)
    return head, parse_header(head, path)


class PinnedRing:
    """A few pinned host buffers a reader thread cycles through: a buffer is refilled only after the device
    copy that read it has finished (its event), so reading the next chunk overlaps the previous copy. Made per
    file read: torch's caching host allocator hands the same pinned blocks back, so pinning is paid once."""

    def __init__(self, device: torch.device, count: int = 3, nbytes: int = CHUNK_BYTES) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        self.events: list[torch.cuda.Event | None] = [None] * count
        self.stream = torch.cuda.Stream(device)
        self.next = 0

    def take(self) -> tuple[torch.Tensor, int]:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()
        return self.buffers[i], i

    def copied(self, i: int) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        self.events[i] = event

    def drain(self) -> None:
        self.stream.synchronize()


Into = Callable[[str, int], torch.Tensor]  # (file name, bytes) -> a uint8 host buffer of that many bytes


def read_file(path: Path, wanted: Callable[[str], bool], device: torch.device, facts: dict | None = None,
              drop_cache: bool = False, into: Into | None = None) -> dict[str, torch.Tensor]:
    """The wanted tensors of one safetensors file, on `device`, as views of one flat buffer. With `facts` (the
    manifest's entry) the size, the header and every tensor read are checked against it; a mismatch raises
    IntegrityError naming the file and tensor. `drop_cache` asks the kernel to forget the file's cached pages
    first (benchmarks: a cold read). `into(name, nbytes)`, when given, supplies that flat buffer instead (host
    memory the caller keeps, e.g. a serving replica's pinned staging): the bytes are read straight into it."""
    if facts is not None and path.stat().st_size != facts["bytes"]:
        raise IntegrityError(f"{path}: {path.stat().st_size} bytes, the manifest says {facts['bytes']}")
    head, pieces = read_header(path)
    if facts is not None and xxh3(head) != facts["header_" + CHECKSUM]:
        raise IntegrityError(f"{path}: header does not match the manifest's checksum")
    pieces = [p for p in pieces if wanted(p.name)]  # sorted by start
    if not pieces:  # e.g. a trainer rank's file of experts another serving rank holds: nothing to read or stage
        return {}
    ends = [p.end for p in pieces]
    runs = _runs(pieces)
    if into is not None and len(runs) == 1 and runs[0][0] == 0 and len(head) % 8 == 0:
        whole = _read_whole_direct(path, head, pieces, runs[0][1], facts, into)
        if whole is not None:
            return whole
    # Each run starts 16-byte aligned in the flat buffer, so every tensor view is aligned to its element size
    # even when the runs between skipped tensors (another rank's experts) have odd lengths.
    places, total = [], 0
    for start, end in runs:
        places.append(total)
        total += -(-(end - start) // 16) * 16
    flat = into(path.name, total) if into is not None else torch.empty(total, dtype=torch.uint8, device=device)
    hashers = {}
    if facts is not None:
        import xxhash

        hashers = {p.name: xxhash.xxh3_64() for p in pieces}
    fd = os.open(path, os.O_RDONLY)
    ring = None
    try:
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        ring = PinnedRing(flat.device) if flat.is_cuda else None
        for (start, end), placed in zip(runs, places):
            offset = start
            while offset < end:
                n = min(CHUNK_BYTES, end - offset)
                if ring is None:
                    target = flat[placed:placed + n].numpy()
                else:
                    buffer, slot = ring.take()
                    target = buffer[:n].numpy()
                _read_exact(fd, memoryview(target), len(head) + offset, path)
                _feed(hashers, pieces, ends, offset, memoryview(target))
                if ring is not None:
                    with torch.cuda.stream(ring.stream):
                        flat[placed:placed + n].copy_(buffer[:n], non_blocking=True)
                    ring.copied(slot)
                offset += n
                placed += n
    finally:
        if ring is not None:  # no copy into `flat` may outlive an error here
            ring.drain()
        os.close(fd)
    for name, hasher in hashers.items():
        expected = facts[CHECKSUM].get(name)
        if hasher.hexdigest() != expected:
            raise IntegrityError(f"{path}: tensor {name} does not match the manifest's checksum")
    out, run_starts = {}, [start for start, _ in runs]
    for p in pieces:
        r = bisect.bisect_right(run_starts, p.start) - 1
        base = places[r] + p.start - run_starts[r]
        out[p.name] = flat[base:base + (p.end - p.start)].view(p.dtype).view(p.shape)
    return out


def _read_whole_direct(path: Path, head: bytes, pieces: list[Piece], data_end: int, facts: dict | None,
                       into: Into) -> dict[str, torch.Tensor] | None:
    """A file every tensor of which is wanted, read whole (header included) with O_DIRECT into a host buffer from
    `into`: large sequential reads straight from the disk into the buffer, no page cache and no copy out of it
    (a cold read at the device's rate, and the cache is not filled with bytes read once). Tensors are views at
    their offsets in the file (the header is padded to 8 bytes, so each stays aligned to its dtype). None, with
    nothing read, where O_DIRECT is unavailable (a filesystem without it) or the buffer is not block-aligned: the
    caller reads through the page cache."""
    size = len(head) + data_end
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (AttributeError, OSError):  # no O_DIRECT on this platform or filesystem (tmpfs refuses it)
        return None
    try:
        flat = into(path.name, -(-size // DIRECT_ALIGN) * DIRECT_ALIGN)
        if flat.data_ptr() % DIRECT_ALIGN:
            return None
        hashers = {}
        if facts is not None:
            import xxhash

            hashers = {p.name: xxhash.xxh3_64() for p in pieces}
        ends, view = [p.end for p in pieces], memoryview(flat.numpy())
        for position in range(0, size, CHUNK_BYTES):
            chunk = view[position:position + CHUNK_BYTES]
            got = 0
            while position + got < size:
                n = os.preadv(fd, [chunk[got:]], position + got)
                if n == 0 or (n % DIRECT_ALIGN and position + got + n < size):
                    raise IntegrityError(f"{path}: ends at byte {position + got + n}, before the data its header "
                                         "describes")
                got += n
                if got == len(chunk):
                    break
            _feed(hashers, pieces, ends, position - len(head), chunk[:min(got, size - position)])
    finally:
        os.close(fd)
    for name, hasher in hashers.items():
        if hasher.hexdigest() != facts[CHECKSUM].get(name):
            raise IntegrityError(f"{path}: tensor {name} does not match the manifest's checksum")
    return {p.name: flat[len(head) + p.start:len(head) + p.end].view(p.dtype).view(p.shape) for p in pieces}


def _runs(pieces: list[Piece]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for p in sorted(pieces, key=lambda p: p.start):
        if runs and runs[-1][1] == p.start:
            runs[-1][1] = p.end
        else:
            runs.append([p.start, p.end])
    return [(s, e) for s, e in runs]


def _read_exact(fd: int, view: memoryview, position: int, path: Path) -> None:
    while view:
        n = os.preadv(fd, [view], position)
        if n == 0:
            raise IntegrityError(f"{path}: ends at byte {position}, before the data its header describes")
        view, position = view[n:], position + n


def _feed(hashers: dict, pieces: list[Piece], ends: list[int], offset: int, chunk: memoryview) -> None:
    """Give each wanted tensor's hasher the part of `chunk` (data bytes offset.. of the file) that is its
    (`pieces` sorted by start, `ends` their ends)."""
    if not hashers:
        return
    end = offset + len(chunk)
    for p in pieces[bisect.bisect_right(ends, offset):]:
        if p.start >= end:
            break
        hashers[p.name].update(chunk[max(p.start, offset) - offset:min(p.end, end) - offset])


def read_files(paths: list[Path], wanted: Callable[[str], bool], device: torch.device,
               facts: dict[str, dict] | None = None, drop_cache: bool = False, into: Into | None = None
               ) -> dict[str, torch.Tensor]:
    """`read_file` over several files in parallel, one thread each (at most 8)."""
    with ThreadPoolExecutor(min(8, max(1, len(paths))), thread_name_prefix="safetensors-read") as pool:
        parts = list(pool.map(lambda p: read_file(p, wanted, device, None if facts is None else facts[p.name],
                                                  drop_cache, into), paths))
    return {k: v for part in parts for k, v in part.items()}
