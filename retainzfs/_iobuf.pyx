# cython: language_level=3, boundscheck=False, wraparound=False
"""GIL-free byte moving for the data path: aligned pooled buffers, staging, gather writes, CRC32C.

Why it exists: every FUSE request's handler needs the GIL, so any time a FUSE, flusher or
readahead thread spends *with* it (a Python loop over 16 KiB checksum pieces, a ``b"".join``
before a write, a copy into a bounce buffer) is time the other handlers wait.  Here those
loops run in C with the GIL released:

* ``AlignedBuf``: page-aligned memory for O_DIRECT reads, handed to the FUSE binding as the
  reply buffer itself (buffer protocol), and back to a small pool when the last reference dies, so
  a cold read is one DMA into it and one copy into the reader (what ext4 does);
* ``pread_aligned``: the O_DIRECT read into such a buffer;
* ``gather_pwrite``: the scatter list of a flush copied into an aligned scratch buffer and
  written, in one call, without a join;
* ``crc32c_pieces``: the CRC32C of every checksum piece of a scatter list (hardware CRC32
  instruction where the CPU has it, Castagnoli table otherwise; the property tests compare
  both with the ``crc32c`` package).
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyObject_GetBuffer, PyBuffer_Release
from libc.errno cimport errno, EINTR
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from posix.stdlib cimport posix_memalign
from posix.unistd cimport pread, pwrite
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS, MAP_FAILED
from cpython.array cimport array, clone
import errno as _errno

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    static uint32_t rz_crc_table[256];
    static int rz_crc_hw = -1;
    static void rz_crc_init(void) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            rz_crc_table[i] = c;
        }
    #if defined(__x86_64__) && defined(__GNUC__)
        __builtin_cpu_init();
        rz_crc_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    #else
        rz_crc_hw = 0;
    #endif
    }
    #if defined(__x86_64__) && defined(__GNUC__)
    __attribute__((target("sse4.2")))
    static uint32_t rz_crc_hw_update(uint32_t crc, const uint8_t *p, size_t n) {
        uint64_t c = crc;
        while (n && ((uintptr_t)p & 7)) { c = __builtin_ia32_crc32qi((uint32_t)c, *p++); n--; }
        while (n >= 8) { uint64_t v; memcpy(&v, p, 8); c = __builtin_ia32_crc32di(c, v); p += 8; n -= 8; }
        while (n) { c = __builtin_ia32_crc32qi((uint32_t)c, *p++); n--; }
        return (uint32_t)c;
    }
    /* three independent pieces at once: the CRC32 instruction's latency is three times its
       throughput, so three dependency chains run at the throughput (pieces start at 0) */
    __attribute__((target("sse4.2")))
    static void rz_crc_hw_x3(const uint8_t *p, size_t piece, uint32_t *out) {
        uint64_t a = 0xffffffffu, b = 0xffffffffu, c = 0xffffffffu;
        const uint8_t *q = p + piece, *r = p + 2 * piece;
        size_t n = piece;
        while (n >= 8) {
            uint64_t x, y, z;
            memcpy(&x, p, 8); memcpy(&y, q, 8); memcpy(&z, r, 8);
            a = __builtin_ia32_crc32di(a, x); b = __builtin_ia32_crc32di(b, y);
            c = __builtin_ia32_crc32di(c, z);
            p += 8; q += 8; r += 8; n -= 8;
        }
        while (n) {
            a = __builtin_ia32_crc32qi((uint32_t)a, *p++); b = __builtin_ia32_crc32qi((uint32_t)b, *q++);
            c = __builtin_ia32_crc32qi((uint32_t)c, *r++); n--;
        }
        out[0] = ~(uint32_t)a; out[1] = ~(uint32_t)b; out[2] = ~(uint32_t)c;
    }
    #define RZ_HAVE_X3 1
    #else
    static uint32_t rz_crc_hw_update(uint32_t crc, const uint8_t *p, size_t n) { return crc; }
    static void rz_crc_hw_x3(const uint8_t *p, size_t piece, uint32_t *out) { }
    #define RZ_HAVE_X3 0
    #endif
    static uint32_t rz_crc_sw_update(uint32_t c, const uint8_t *p, size_t n) {
        while (n--) c = rz_crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
        return c;
    }
    /* CRC32C (Castagnoli, reflected, init/xorout 0xffffffff) continued from `crc` */
    static uint32_t rz_crc32c(uint32_t crc, const uint8_t *p, size_t n, int hw) {
        crc = ~crc;
        crc = hw ? rz_crc_hw_update(crc, p, n) : rz_crc_sw_update(crc, p, n);
        return ~crc;
    }
    """
    void rz_crc_init() nogil
    int rz_crc_hw
    uint32_t rz_crc32c(uint32_t crc, const uint8_t *p, size_t n, int hw) nogil
    void rz_crc_hw_x3(const uint8_t *p, size_t piece, uint32_t *out) nogil

rz_crc_init()

PAGE = 4096
#: pooled sizes are powers of two from 64 KiB to 16 MiB; at most POOL_KEEP of each are kept
#: (fewer of the large ones: 32 MiB per class), and of the 1 MiB class, which FUSE write
#: requests use (``_fuse``: a write's bytes land in an AlignedBuf and go to the device from
#: there), POOL_KEEP_WRITE: a fresh mapping costs a fault and a zeroing per page, as much as
#: the copy it saves, so the buffers of the writes in flight (8 writers: ~64 MiB) are reused.
#: ``pool_trim`` gives them all back once writing stops (the mount's idle hook).
cdef int _MIN_SHIFT = 16
cdef int _MAX_SHIFT = 24
cdef int POOL_KEEP = 16
cdef int POOL_KEEP_WRITE = 96
cdef int _WRITE_SHIFT = 20
cdef void* _pool[9][96]
cdef int _pool_n[9]
cdef char *_FMT_B = "B"
#: buffers of this size or more are mapped, not taken from the heap: freed (beyond the pool)
#: they go back to the kernel at once.  From the heap (whose mmap threshold the mount raises
#: to 64 MiB for the 1 MiB write-request buffers) they fragmented it, and a daemon that ran
#: 8 writers then 8 readers of 128 MiB eight times in a row grew from 210 to 600 MiB RSS.
cdef size_t _MAP_MIN = 256 << 10
#: bytes of aligned buffers alive (held by requests, write buffers, windows; not the pool)
cdef size_t _live = 0
cdef size_t _live_peak = 0
#: bytes the pool may keep in all (``set_pool_limit``: the mount lowers it under a memory
#: limit) and keeps now
cdef size_t _pool_cap = <size_t>-1
cdef size_t _pooled = 0


cdef int _size_class(size_t n) noexcept nogil:
    cdef int s = _MIN_SHIFT
    while s <= _MAX_SHIFT and (<size_t>1 << s) < n:
        s += 1
    return s


cdef inline int _keep(int cls) noexcept nogil:
    """How many freed buffers of size class ``cls`` the pool keeps."""
    if cls == _WRITE_SHIFT:
        return POOL_KEEP_WRITE
    return POOL_KEEP if cls <= 21 else (1 << (25 - cls))


cdef class AlignedBuf:
    """Page-aligned memory; the buffer protocol exposes ``[start, start + length)``.

    The memory goes back to the pool when the object dies (``_fuse`` drops its reply buffer
    after ``fuse_reply_buf``), so a stream of 1 MiB reads reuses faulted-in pages."""
    cdef char *mem
    cdef size_t cap
    cdef int cls
    cdef Py_ssize_t start, length
    cdef Py_ssize_t shape[1]

    def __cinit__(self, size_t n):
        cdef void *p = NULL
        global _pooled
        self.cls = _size_class(n)
        if self.cls <= _MAX_SHIFT:
            self.cap = <size_t>1 << self.cls
            i = self.cls - _MIN_SHIFT
            if _pool_n[i]:
                _pool_n[i] -= 1
                p = _pool[i][_pool_n[i]]
                _pooled -= self.cap
        else:
            self.cap = (n + PAGE - 1) // PAGE * PAGE
        if p == NULL:
            if self.cap >= _MAP_MIN:
                p = mmap(NULL, self.cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                if p == MAP_FAILED:
                    raise MemoryError()
            elif posix_memalign(&p, PAGE, self.cap) != 0:
                raise MemoryError()
        self.mem = <char *>p
        self.start = 0
        self.length = n
        global _live, _live_peak
        _live += self.cap
        if _live > _live_peak:
            _live_peak = _live

    def __dealloc__(self):
        cdef int i
        global _live, _pooled
        if self.mem == NULL:
            return
        _live -= self.cap
        if self.cls <= _MAX_SHIFT:
            i = self.cls - _MIN_SHIFT
            # at most 32 MiB kept per size class above 2 MiB, and ``_pool_cap`` in all: the
            # daemon's RSS stays bounded
            if _pool_n[i] < _keep(self.cls) and _pooled + self.cap <= _pool_cap:
                _pool[i][_pool_n[i]] = self.mem
                _pool_n[i] += 1
                _pooled += self.cap
                self.mem = NULL
                return
        if self.cap >= _MAP_MIN:
            munmap(self.mem, self.cap)
        else:
            free(self.mem)
        self.mem = NULL

    def __len__(self):
        return self.length

    def __getbuffer__(self, Py_buffer *view, int flags):
        self.shape[0] = self.length
        view.buf = self.mem + self.start
        view.obj = self
        view.len = self.length
        view.readonly = 0
        view.itemsize = 1
        view.format = _FMT_B if (flags & 4) else NULL    # PyBUF_FORMAT
        view.ndim = 1
        view.shape = self.shape
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL



def pread_aligned(int fd, long long off, Py_ssize_t length, Py_ssize_t align):
    """O_DIRECT read of ``length`` bytes at ``off`` (any alignment) into a fresh AlignedBuf
    covering the aligned span; the buffer shows exactly the requested bytes.  OSError with
    the read's errno; EIO for a short read (past the end of the file)."""
    cdef long long a = off - off % align
    cdef long long e = (off + length + align - 1) // align * align
    cdef AlignedBuf b = AlignedBuf(<size_t>(e - a))
    cdef Py_ssize_t got = 0, want = e - a
    cdef ssize_t r = 0
    cdef int err = 0
    with nogil:
        while got < want:
            r = pread(fd, b.mem + got, want - got, a + got)
            if r < 0:
                if errno == EINTR:
                    continue
                err = errno
                break
            if r == 0:
                break
            got += r
    if err:
        raise OSError(err, f"direct read at {a + got}: {_errno.errorcode.get(err, err)}")
    if got < (off - a) + length:
        raise OSError(_errno.EIO, f"short direct read at {a + got}")
    b.start = off - a
    b.length = length
    return b


cdef int _write_all(int fd, const char *buf, Py_ssize_t n, long long off) noexcept nogil:
    """pwrite all ``n`` bytes (retrying EINTR and short writes); 0 or the errno."""
    cdef Py_ssize_t w = 0
    cdef ssize_t r
    while w < n:
        r = pwrite(fd, buf + w, n - w, off + w)
        if r < 0 and errno == EINTR:
            continue
        if r <= 0:
            return errno if r < 0 else 5          # EIO: a zero-byte write
        w += r
    return 0


def gather_pwrite(int fd, long long off, parts, Py_ssize_t n, AlignedBuf scratch):
    """Write the first ``n`` bytes of the buffers ``parts`` at ``off`` through ``scratch``
    (aligned; ``off`` and every chunk's length a multiple of the caller's alignment), copying
    each part once and holding no GIL for copies or writes.  Returns bytes written; raises
    OSError with the write's errno."""
    cdef Py_buffer pb
    cdef Py_ssize_t cap = <Py_ssize_t>scratch.cap
    cdef Py_ssize_t fill = 0, done = 0, take, pos, plen
    cdef int err = 0
    cdef char *src
    for p in parts:
        if done + fill >= n:
            break
        PyObject_GetBuffer(p, &pb, PyBUF_SIMPLE)
        try:
            src = <char *>pb.buf
            plen = min(pb.len, n - done - fill)
            pos = 0
            with nogil:
                while pos < plen:
                    take = min(plen - pos, cap - fill)
                    memcpy(scratch.mem + fill, src + pos, take)
                    fill += take
                    pos += take
                    if fill == cap:
                        err = _write_all(fd, scratch.mem, fill, off + done)
                        if err:
                            break
                        done += fill
                        fill = 0
        finally:
            PyBuffer_Release(&pb)
        if err:
            raise OSError(err, f"direct write at {off + done}")
    if fill:
        with nogil:
            err = _write_all(fd, scratch.mem, fill, off + done)
        if err:
            raise OSError(err, f"direct write at {off + done}")
        done += fill
    return done




def gather_crc(parts, Py_ssize_t n, Py_ssize_t padded, Py_ssize_t piece):
    """The staging copy of a flush: the first ``n`` bytes of the buffers ``parts`` copied into
    a (pooled) page-aligned AlignedBuf of ``padded`` >= n bytes, the rest zeros, and the
    CRC32C of each ``piece`` of that padded buffer (what ``crc32c_pieces([buf], padded,
    piece)`` gives), in one pass without the GIL: each three pieces are checksummed right
    after they are copied, while they are still in the cache.  Returns (buffer, CRCs).

    Why staged at all: the data path copies a flush's scatter list here *before* it takes
    io_lock, so the copy O_DIRECT needs overlaps another file's device write instead of
    preceding its own.

    Why: one pass over the bytes instead of two (the copy, then the CRCs reading the copy back
    from memory): 0.44 -> 0.41 ms per 4 MiB on a quiet core.  (In the daemon a stage with 8
    writers takes ~2 ms of wall time for 0.65 ms of CPU: the rest is waiting for the GIL.)"""
    if padded < n or n < 0 or piece <= 0:
        raise ValueError(f"gather_crc: padded length {padded} < {n}")
    plist = list(parts)
    cdef Py_ssize_t np_ = len(plist), i, got = 0
    cdef Py_buffer *pbs = <Py_buffer *>malloc(max(np_, 1) * sizeof(Py_buffer))
    if pbs == NULL:
        raise MemoryError()
    cdef AlignedBuf b
    cdef array out
    cdef uint32_t *o
    cdef Py_ssize_t fill = 0, done = 0, k = 0, pi = 0, ppos = 0, target, take, ln
    cdef Py_ssize_t block = 3 * piece
    cdef int hw = rz_crc_hw
    try:
        for i in range(np_):
            PyObject_GetBuffer(plist[i], &pbs[i], PyBUF_SIMPLE)
            got += 1
        b = AlignedBuf(<size_t>padded)
        out = clone(array("I"), (padded + piece - 1) // piece, False)
        o = out.data.as_uints
        with nogil:
            while fill < n:
                target = min(n, done + block)
                while fill < target and pi < np_:
                    take = min(pbs[pi].len - ppos, target - fill)
                    memcpy(b.mem + fill, <char *>pbs[pi].buf + ppos, take)
                    fill += take
                    ppos += take
                    if ppos == pbs[pi].len:
                        pi += 1
                        ppos = 0
                if fill < target:
                    break                                     # the parts are short
                if hw and fill - done == block:
                    rz_crc_hw_x3(<const uint8_t *>b.mem + done, piece, o + k)
                    k += 3
                    done += block
                else:
                    while fill - done >= piece:
                        o[k] = rz_crc32c(0, <const uint8_t *>b.mem + done, piece, hw)
                        k += 1
                        done += piece
            if fill == n:
                memset(b.mem + n, 0, padded - n)
                while done < padded:                          # the tail, zeros included
                    ln = min(piece, padded - done)
                    o[k] = rz_crc32c(0, <const uint8_t *>b.mem + done, ln, hw)
                    k += 1
                    done += ln
    finally:
        for i in range(got):
            PyBuffer_Release(&pbs[i])
        free(pbs)
    if fill != n:
        raise ValueError(f"gather_crc: {fill} bytes in the parts, {n} expected")
    return b, out


def assemble(parts, Py_ssize_t size):
    """One reply of ``size`` bytes from pieces: ``parts`` = [(dst, buffer)], each copied to
    ``dst`` (a later part overwrites an earlier one where they overlap, e.g. buffered bytes
    over a zone's), the bytes no part covers zeros (a hole).  A pooled page-aligned
    AlignedBuf, filled with the GIL released.

    Why: a 1 MiB read whose bytes lie in two extents (8 writers' flushes interleave in one
    zone, so about one request in four) was put together in a fresh ``bytearray`` on the
    FUSE loop, holding the GIL: a 1 MiB allocation (pages faulted in and zeroed by the
    kernel, given back at free) and two copies, 12 % of the loop's time for 8 readers."""
    cdef AlignedBuf b = AlignedBuf(<size_t>size)
    cdef Py_buffer pb
    cdef Py_ssize_t dst, take, covered = 0
    cdef bint sequential = True
    for dst, p in parts:                 # pieces in order with no gap: nothing to zero
        if dst != covered:
            sequential = False
            break
        covered += len(p)
    if not sequential or covered < size:
        with nogil:
            memset(b.mem, 0, size)
    for dst, p in parts:
        if dst < 0 or dst >= size:
            raise ValueError(f"assemble: part at {dst} outside [0, {size})")
        PyObject_GetBuffer(p, &pb, PyBUF_SIMPLE)
        try:
            take = min(pb.len, size - dst)
            with nogil:
                memcpy(b.mem + dst, pb.buf, take)
        finally:
            PyBuffer_Release(&pb)
    return b


def crc32c(data, unsigned int value=0):
    """CRC32C of a buffer, continued from ``value`` (same results as ``crc32c.crc32c``)."""
    cdef Py_buffer pb
    cdef uint32_t c = value
    PyObject_GetBuffer(data, &pb, PyBUF_SIMPLE)
    try:
        with nogil:
            c = rz_crc32c(c, <const uint8_t *>pb.buf, pb.len, rz_crc_hw)
    finally:
        PyBuffer_Release(&pb)
    return c


def crc32c_pieces(parts, Py_ssize_t length, Py_ssize_t piece):
    """array('I') of the CRC32C of each ``piece``-byte piece (the last may be short) of the
    first ``length`` bytes of the buffers ``parts``."""
    cdef array out = clone(array("I"), (length + piece - 1) // piece, False)
    cdef uint32_t *o = out.data.as_uints
    cdef Py_buffer pb
    cdef Py_ssize_t k = 0, fill = 0, done = 0, pos, plen, take
    cdef uint32_t crc = 0
    cdef int hw = rz_crc_hw
    for p in parts:
        if done >= length:
            break
        PyObject_GetBuffer(p, &pb, PyBUF_SIMPLE)
        try:
            plen = min(pb.len, length - done)
            pos = 0
            with nogil:
                while pos < plen:
                    if hw and fill == 0 and plen - pos >= 3 * piece:
                        rz_crc_hw_x3(<const uint8_t *>pb.buf + pos, piece, o + k)
                        k += 3
                        pos += 3 * piece
                        continue
                    take = min(plen - pos, piece - fill)
                    crc = rz_crc32c(crc, <const uint8_t *>pb.buf + pos, take, hw)
                    fill += take
                    pos += take
                    if fill == piece:
                        o[k] = crc
                        k += 1
                        crc = 0
                        fill = 0
            done += plen
        finally:
            PyBuffer_Release(&pb)
    if fill:
        o[k] = crc
        k += 1
    if done != length:
        raise ValueError(f"crc32c_pieces: {done} bytes in the parts, {length} expected")
    return out


_HW = rz_crc_hw == 1


def live_bytes() -> int:
    """Bytes of aligned buffers alive now (write buffers' arenas, replies, readahead windows,
    staging): with ``pooled_bytes``, what the daemon's RSS owes to I/O buffers."""
    return _live


def live_peak_bytes() -> int:
    """The most ``live_bytes`` has been since the daemon started."""
    return _live_peak


def pooled_bytes() -> int:
    """Bytes of freed aligned buffers the pool holds for reuse (part of the daemon's RSS)."""
    cdef int i
    cdef size_t n = 0
    for i in range(_MAX_SHIFT - _MIN_SHIFT + 1):
        n += <size_t>_pool_n[i] << (i + _MIN_SHIFT)
    return n


cdef class WriteArenas:
    """Where the FUSE binding copies the payload of large write requests: 1 MiB page-aligned
    arenas, one open per file, filled in file order, so a flush of them goes to an O_DIRECT
    device with no staging copy (``DataPath.stage``: each part page-aligned, whole blocks).

    Why arenas and not a buffer per request: an application's 1 MiB ``write`` from memory that
    is not page-aligned (any Python ``bytes``, most tensors) reaches the daemon as two requests,
    1 MiB less a few bytes and those few bytes (the kernel caps a request at 256 pages);
    copied into an arena in turn, they fill it exactly and ``WriteBuffer`` joins the two
    views into one (``join_views``).

    ``reserve(key, off, n)`` gives a writable view of ``n`` bytes to copy a write at file
    offset ``off`` into: the rest of the file's open arena if the write continues it and
    fits; if it continues it and does not fit, two views (a tuple): the rest of that arena
    and the start of a new one, for the write's first and last bytes; else a new arena when
    ``n >= min_new`` (else None: a small write, copied elsewhere), the write placed where its
    offset falls within a page (two views again if that leaves less room than ``n``).
    Memory: a view keeps its arena alive; a new arena is made only for a write of at least
    half an arena (so at most twice the bytes held), at most ``max_open`` files have one open
    (the oldest is let go), and ``drop`` lets go of a file's (its close).  Needs the GIL;
    the copy into a reserved view may run without it (views never overlap)."""
    cdef dict _open
    cdef public Py_ssize_t size, min_new, max_open

    def __init__(self, Py_ssize_t size=1 << 20, Py_ssize_t min_new=512 << 10,
                 Py_ssize_t max_open=64):
        if size <= 0 or min_new <= 0 or max_open <= 0 or size % PAGE:
            raise ValueError("WriteArenas: sizes must be positive, arenas whole pages")
        self._open = {}
        self.size, self.min_new, self.max_open = size, min_new, max_open

    def reserve(self, key, long long off, Py_ssize_t n):
        cdef list a = self._open.get(key)
        cdef Py_ssize_t fill, r
        if a is not None:
            fill = a[2]
            if off == a[1] + fill:
                if fill + n <= self.size:
                    a[2] = fill + n
                    if fill + n == self.size:
                        del self._open[key]
                    return memoryview(a[0])[fill:fill + n]
                # it runs past the arena: the rest of this one, then a new one from its
                # start, so every arena of a file written in order is filled whole and each
                # part stays page-aligned (a large write from unaligned memory arrives as
                # 1 MiB - 48 bytes, then 1 MiB requests: one arena each, they would all
                # start 48 bytes short and no flush could skip its staging copy)
                r = self.size - fill
                del self._open[key]
                return (memoryview(a[0])[fill:self.size],
                        self._new(key, off + r, n - r))
            del self._open[key]
        if n < self.min_new or n <= 0:
            return None
        return self._new(key, off, n)

    def _new(self, key, long long off, Py_ssize_t n):
        """A view of ``n`` bytes in a new arena, starting where ``off`` falls within a page,
        so every byte sits at an address congruent to its file offset modulo the page: a
        flush from a block boundary then takes whole blocks from the arenas as they are
        (``DataPath.stage``), even when the file's first bytes were a small write (the zip
        header before a tensor in ``torch.save`` and DCP).  Kept open for the file's next
        write unless ``n`` fills it; a write that would run past the arena fills its rest and
        starts the next arena (two views)."""
        cdef Py_ssize_t o = off % PAGE, r
        if o == 0 and n >= self.size:
            return memoryview(AlignedBuf(n))
        buf = AlignedBuf(self.size)
        if o + n >= self.size:
            r = self.size - o
            head = memoryview(buf)[o:self.size]
            if r == n:
                return head
            return (head, self._new(key, off + r, n - r))
        while len(self._open) >= self.max_open:
            del self._open[next(iter(self._open))]
        self._open[key] = [buf, off - o, o + n]
        return memoryview(buf)[o:o + n]

    def drop(self, key) -> None:
        self._open.pop(key, None)

    def __len__(self):
        return len(self._open)


def starts_its_object(v) -> bool:
    """True when ``v`` is a byte view whose memory begins where its object's does (the first
    bytes of a write arena, ``WriteArenas.reserve``'s second view)."""
    if type(v) is not memoryview or v.obj is None:
        return False
    cdef Py_buffer pv, po
    PyObject_GetBuffer(v, &pv, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(v.obj, &po, PyBUF_SIMPLE)
        try:
            return pv.buf == po.buf
        finally:
            PyBuffer_Release(&po)
    finally:
        PyBuffer_Release(&pv)


def buffer_addresses(parts) -> list:
    """The address of each buffer of ``parts`` (where its first byte is in memory)."""
    cdef Py_buffer pb
    out = []
    for p in parts:
        PyObject_GetBuffer(p, &pb, PyBUF_SIMPLE)
        out.append(<size_t>pb.buf)
        PyBuffer_Release(&pb)
    return out


def arena_slack(parts) -> int:
    """Bytes of memory that ``parts`` keep alive but do not show: for each distinct object
    some memoryview part is a view of, its size (an ``AlignedBuf``'s capacity) less what those
    views show.  A write buffer holding half an arena pins the whole arena (``WriteArenas``),
    and the last few bytes of a 300 KB write request (a ``bytes``) left by a flush in whole
    blocks pin all 300 KB; the write buffers' budget (``dirty_bytes``) counts this, or 300
    files written 512 KiB + 1 byte at a time held twice ``dirty_bytes`` in arenas, and 2,000
    files held open after one 300 KB write each held 600 MB for 2 MB of buffered bytes."""
    cdef dict seen = {}
    cdef Py_ssize_t slack = 0
    cdef Py_buffer po
    for p in parts:
        if type(p) is not memoryview:
            continue
        o = p.obj
        if o is None:
            continue
        k = id(o)
        if k not in seen:
            seen[k] = o
            if type(o) is AlignedBuf:
                slack += <Py_ssize_t>(<AlignedBuf>o).cap
            else:
                PyObject_GetBuffer(o, &po, PyBUF_SIMPLE)
                slack += po.len
                PyBuffer_Release(&po)
        slack -= (<memoryview>p).nbytes
    return max(slack, 0)


def join_views(a, b):
    """One view of ``a``'s bytes then ``b``'s when both are byte views of the same object
    and ``b``'s memory starts where ``a``'s ends (two requests copied into one arena in
    turn, ``WriteArenas``); else None."""
    if type(a) is not memoryview or type(b) is not memoryview:
        return None
    obj = a.obj
    if obj is None or b.obj is not obj or not a.c_contiguous or not b.c_contiguous:
        return None
    cdef Py_buffer pa, pb, po
    cdef Py_ssize_t start
    PyObject_GetBuffer(a, &pa, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(b, &pb, PyBUF_SIMPLE)
        try:
            if <char *>pa.buf + pa.len != <char *>pb.buf:
                return None
            PyObject_GetBuffer(obj, &po, PyBUF_SIMPLE)
            try:
                start = <char *>pa.buf - <char *>po.buf
                if start < 0 or start + pa.len + pb.len > po.len:
                    return None
            finally:
                PyBuffer_Release(&po)
            return memoryview(obj)[start:start + pa.len + pb.len]
        finally:
            PyBuffer_Release(&pb)
    finally:
        PyBuffer_Release(&pa)


def set_pool_limit(size_t limit) -> None:
    """Keep at most ``limit`` bytes of freed buffers (the mount's memory budget:
    ``retainzfs.memory``); what the pool holds beyond it goes back to the kernel now."""
    global _pool_cap
    _pool_cap = limit
    if _pooled > limit:
        pool_trim()


def pool_limit() -> int:
    return _pool_cap


def pool_trim() -> int:
    """Give every pooled buffer back to the kernel (after a burst of writes: the mount's idle
    hook); returns the bytes freed.  Needs the GIL (as every pool change does)."""
    cdef int i, cls
    cdef size_t n = 0, cap
    global _pooled
    for i in range(_MAX_SHIFT - _MIN_SHIFT + 1):
        cls = i + _MIN_SHIFT
        cap = <size_t>1 << cls
        while _pool_n[i]:
            _pool_n[i] -= 1
            if cap >= _MAP_MIN:
                munmap(_pool[i][_pool_n[i]], cap)
            else:
                free(_pool[i][_pool_n[i]])
            n += cap
    _pooled = 0
    return n


def aligned_parts(parts, Py_ssize_t align, Py_ssize_t max_parts=1024) -> bool:
    """True when every buffer of ``parts`` starts on a page and is a multiple of ``align``
    bytes long, and there are at most ``max_parts`` (IOV_MAX) of them: what an O_DIRECT
    ``pwritev`` takes straight from the caller's memory, with no staging copy."""
    cdef Py_buffer pb
    cdef Py_ssize_t k = 0
    for p in parts:
        k += 1
        if k > max_parts:
            return False
        PyObject_GetBuffer(p, &pb, PyBUF_SIMPLE)
        try:
            if (<size_t>pb.buf) % PAGE or pb.len % align or pb.len == 0:
                return False
        finally:
            PyBuffer_Release(&pb)
    return k > 0


def hardware_crc() -> bool:
    """True when the CPU's CRC32 instruction is in use."""
    return rz_crc_hw == 1


def set_hardware_crc(bint on) -> None:
    """For tests: use the table implementation (False) or the instruction where present."""
    global rz_crc_hw
    rz_crc_hw = 1 if (on and _HW) else 0
