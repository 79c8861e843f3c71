# cython: language_level=3
"""The FUSE binding: libfuse's low-level API on its multi-threaded loop, calling the store.

Why our own and not pyfuse3: pyfuse3 receives, dispatches and answers every request on one
trio thread holding the GIL, including the copy of each 1 MiB write payload into a ``bytes`` and
the ``writev`` of each 1 MiB read reply; measured (``scripts/bench_fuse_ceiling.py``), that one
thread capped 8 parallel readers and writers below the disk whatever the store did.  Here
libfuse's own threads (``fuse_session_loop_mt``) read ``/dev/fuse`` and answer with no
interpreter lock; a request takes the GIL only to call the Python handler, and the payload
copies (write payload -> ``bytes``, reply buffer -> kernel) run with it released.

The handlers (``retainzfs.fs.Operations``) are plain synchronous methods that run in the
receiving thread (blocking it, not the others), so there is no event loop and no hop to a worker
thread.  Each libfuse thread gets one Python thread state for its life (``rz_attach``), so
taking the GIL is a lock acquisition, not a thread-state allocation per request.

Protocol choices that match what the file system was verified with on pyfuse3 (pjdfstest, fsx):
READDIRPLUS always (the kernel takes a lookup reference for each entry but ``.`` and ``..``: the
handler counts it), EXPORT_SUPPORT (``..`` lookups), no writeback cache; POSIX ACLs with
DONT_MASK when the file system asks (``want_acl``); LSEEK for SEEK_DATA/SEEK_HOLE (the kernel
answers the other whences); IOCTL, locks and copy_file_range answer ENOSYS (libfuse's default
for a missing handler); a file opened read-only (not O_TRUNC)
gets FOPEN_NOFLUSH, so its close sends no FLUSH (``rz_fi_set``).  Handlers run holding the GIL and
send their reply without it (``_rp_*``).
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

import errno as _errno
import logging
import os

from ._iobuf import WriteArenas
from .errors import FsError

log = logging.getLogger("retainzfs")

cdef extern from "<sys/stat.h>":
    struct timespec:
        long tv_sec
        long tv_nsec
    struct stat:
        unsigned long st_ino
        unsigned int st_mode
        unsigned long st_nlink
        unsigned int st_uid
        unsigned int st_gid
        unsigned long st_rdev
        long st_size
        long st_blksize
        long st_blocks
        timespec st_atim
        timespec st_mtim
        timespec st_ctim

cdef extern from "<fcntl.h>" nogil:
    int O_DSYNC


cdef extern from "<time.h>" nogil:
    int clock_gettime(int clk, timespec *ts)
    int CLOCK_REALTIME

cdef extern from *:
    """
    #define FUSE_USE_VERSION 312
    #include <fuse_lowlevel.h>
    #include <sys/statvfs.h>
    #define RZ_MAX_BACKGROUND 64

    /* One Python thread state per libfuse thread, made at its first request and kept (the
     * gilstate count never drops to zero), so ``with gil`` afterwards only takes the lock. */
    static __thread int rz_attached = 0;
    static void rz_attach(void) {
        if (!rz_attached) {
            PyGILState_Ensure();
            PyEval_SaveThread();
            rz_attached = 1;
        }
    }
    static void rz_fi_set(struct fuse_file_info *fi, uint64_t fh, int direct_io, int keep_cache) {
        fi->fh = fh;
        fi->direct_io = direct_io ? 1 : 0;
        fi->keep_cache = keep_cache ? 1 : 0;
        /* A descriptor opened only to read (and not to truncate) has nothing for a close to
         * commit: FOPEN_NOFLUSH spares the FLUSH round trip of its close(2) (the RELEASE
         * still comes).  A restore opens every file of a checkpoint this way. */
        fi->noflush = ((fi->flags & O_ACCMODE) == O_RDONLY && !(fi->flags & O_TRUNC)) ? 1 : 0;
    }
    /* libfuse's own messages go to stderr (the daemon's log) with a time and a level, as
     * Python's logging writes its lines, and a message repeated within a minute is counted,
     * not written: under a pids limit libfuse says "error creating thread" at every request
     * that finds no idle thread (3,146 lines in 3 s of 16 writers before). */
    #include <stdarg.h>
    #include <stdio.h>
    #include <string.h>
    #include <pthread.h>
    #include <sys/time.h>
    static pthread_mutex_t rz_log_mu = PTHREAD_MUTEX_INITIALIZER;
    static char rz_log_last[512];
    static unsigned long rz_log_repeats = 0;
    static time_t rz_log_at = 0;
    static const char *rz_log_level_name(enum fuse_log_level level) {
        return level <= FUSE_LOG_ERR ? "ERROR" : level == FUSE_LOG_WARNING ? "WARNING"
             : level == FUSE_LOG_DEBUG ? "DEBUG" : "INFO";
    }
    static void rz_log_line(enum fuse_log_level level, const char *msg) {
        struct timeval tv;
        struct tm tm;
        char when[32];
        gettimeofday(&tv, NULL);
        localtime_r(&tv.tv_sec, &tm);
        strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
        fprintf(stderr, "%s,%03d %s libfuse: %s\\n", when, (int)(tv.tv_usec / 1000),
                rz_log_level_name(level), msg);
        fflush(stderr);
    }
    static void rz_log_flush_repeats_locked(void) {
        char note[600];
        if (rz_log_repeats) {
            snprintf(note, sizeof note, "%s (%lu more times)", rz_log_last, rz_log_repeats);
            rz_log_line(FUSE_LOG_WARNING, note);
            rz_log_repeats = 0;
        }
    }
    static void rz_fuse_log(enum fuse_log_level level, const char *fmt, va_list ap) {
        char msg[512];
        size_t n;
        time_t now = time(NULL);
        vsnprintf(msg, sizeof msg, fmt, ap);
        n = strlen(msg);
        while (n && (msg[n - 1] == '\\n' || msg[n - 1] == ' '))
            msg[--n] = 0;
        if (strncmp(msg, "fuse: ", 6) == 0)
            memmove(msg, msg + 6, n - 5);
        pthread_mutex_lock(&rz_log_mu);
        if (strcmp(msg, rz_log_last) == 0 && now - rz_log_at < 60) {
            rz_log_repeats++;
        } else {
            rz_log_flush_repeats_locked();
            rz_log_line(level, msg);
            memcpy(rz_log_last, msg, sizeof msg);
            rz_log_at = now;
        }
        pthread_mutex_unlock(&rz_log_mu);
    }
    static void rz_log_install(void) { fuse_set_log_func(rz_fuse_log); }
    static void rz_log_flush(void) {
        pthread_mutex_lock(&rz_log_mu);
        rz_log_flush_repeats_locked();
        rz_log_last[0] = 0;
        pthread_mutex_unlock(&rz_log_mu);
    }
    /* want_acl: FUSE_POSIX_ACL, the kernel then enforces ACLs (and implies
     * default_permissions); with DONT_MASK, so that a default ACL can replace the umask
     * (the umask comes in the request's context).  Returns whether ACLs are on. */
    static int rz_init_conn(struct fuse_conn_info *conn, int want_acl) {
        if (want_acl && (conn->capable & FUSE_CAP_POSIX_ACL)
                && (conn->capable & FUSE_CAP_DONT_MASK))
            conn->want |= FUSE_CAP_POSIX_ACL | FUSE_CAP_DONT_MASK;
        conn->want &= ~FUSE_CAP_READDIRPLUS_AUTO;
        if (conn->capable & FUSE_CAP_EXPORT_SUPPORT)
            conn->want |= FUSE_CAP_EXPORT_SUPPORT;
        conn->want &= ~FUSE_CAP_WRITEBACK_CACHE;
        /* No AUTO_INVAL_DATA (libfuse's default; meant for network file systems whose
         * data changes behind the kernel): with it, a read after a write through the same
         * kernel finds the daemon's new mtime and drops the file's whole page cache,
         * mapped pages included.  stress-ng's mmap stressor (write a page from its own
         * mapping, read the next one into it, 65,536 times) made no progress in 8 s.  All
         * of a file's changes pass through this kernel, which keeps its cache coherent
         * (direct writes, copy_file_range, truncation invalidate the ranges they touch). */
        conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;
        /* No ASYNC_DIO (libfuse's default): with it the kernel sends an AIO O_DIRECT write's
         * requests and completes it later without dropping the pages that buffered readers
         * cached meanwhile, so a read after the completion served the bytes it replaced
         * (xfstests' generic/451; tests/aio_rewrite.c: 1,203 of 7,346 rewrites stale in
         * 20 s).  Synchronous direct I/O is invalidated after the write, as on any file
         * system.  The cost: io_submit of an O_DIRECT request waits for it, and one large
         * O_DIRECT read is no longer split into parallel requests (libaio depth 8, 1 MiB:
         * 2,073 -> 1,380 MiB/s); buffered and write-only (FOPEN_DIRECT_IO) I/O, what
         * checkpoint writers and loaders use, are unchanged. */
        conn->want &= ~FUSE_CAP_ASYNC_DIO;
        /* readahead and direct-I/O requests in flight at once (the kernel's default, 12,
         * is one and a half 1 MiB readahead requests per file for 8 readers) */
        conn->max_background = RZ_MAX_BACKGROUND;
        conn->congestion_threshold = RZ_MAX_BACKGROUND * 3 / 4;
        return (conn->want & FUSE_CAP_POSIX_ACL) != 0;
    }
    """
    void rz_attach() nogil
    void rz_log_install()
    void rz_log_flush() nogil

    ctypedef uint64_t fuse_ino_t
    struct fuse_req:
        pass
    ctypedef fuse_req *fuse_req_t
    struct fuse_session:
        pass
    struct fuse_conn_info:
        unsigned capable
        unsigned want
    struct fuse_file_info:
        int flags
        uint64_t fh
    struct fuse_entry_param:
        fuse_ino_t ino
        uint64_t generation
        stat attr
        double attr_timeout
        double entry_timeout
    struct fuse_ctx:
        unsigned int uid
        unsigned int gid
        int pid
        unsigned int umask
    struct fuse_forget_data:
        uint64_t ino
        uint64_t nlookup
    struct fuse_args:
        int argc
        char **argv
        int allocated
    struct fuse_loop_config:
        pass
    struct statvfs:
        unsigned long f_bsize
        unsigned long f_frsize
        unsigned long f_blocks
        unsigned long f_bfree
        unsigned long f_bavail
        unsigned long f_files
        unsigned long f_ffree
        unsigned long f_favail
        unsigned long f_namemax

    void rz_fi_set(fuse_file_info *fi, uint64_t fh, int direct_io, int keep_cache) nogil
    int rz_init_conn(fuse_conn_info *conn, int want_acl) nogil

    struct fuse_lowlevel_ops:
        void (*init)(void *userdata, fuse_conn_info *conn) noexcept nogil
        void (*lookup)(fuse_req_t req, fuse_ino_t parent, const char *name) noexcept nogil
        void (*forget)(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) noexcept nogil
        void (*forget_multi)(fuse_req_t req, size_t count, fuse_forget_data *forgets) noexcept nogil
        void (*getattr)(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil
        void (*setattr)(fuse_req_t req, fuse_ino_t ino, stat *attr, int to_set,
                        fuse_file_info *fi) noexcept nogil
        void (*readlink)(fuse_req_t req, fuse_ino_t ino) noexcept nogil
        void (*mknod)(fuse_req_t req, fuse_ino_t parent, const char *name, unsigned int mode,
                      unsigned long rdev) noexcept nogil
        void (*mkdir)(fuse_req_t req, fuse_ino_t parent, const char *name,
                      unsigned int mode) noexcept nogil
        void (*unlink)(fuse_req_t req, fuse_ino_t parent, const char *name) noexcept nogil
        void (*rmdir)(fuse_req_t req, fuse_ino_t parent, const char *name) noexcept nogil
        void (*symlink)(fuse_req_t req, const char *link, fuse_ino_t parent,
                        const char *name) noexcept nogil
        void (*rename)(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                       const char *newname, unsigned int flags) noexcept nogil
        void (*link)(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent,
                     const char *newname) noexcept nogil
        void (*open)(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil
        void (*read)(fuse_req_t req, fuse_ino_t ino, size_t size, long off,
                     fuse_file_info *fi) noexcept nogil
        void (*write)(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, long off,
                      fuse_file_info *fi) noexcept nogil
        void (*flush)(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil
        void (*release)(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil
        void (*fsync)(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info *fi) noexcept nogil
        void (*fallocate)(fuse_req_t req, fuse_ino_t ino, int mode, long offset, long length,
                          fuse_file_info *fi) noexcept nogil
        void (*lseek)(fuse_req_t req, fuse_ino_t ino, long off, int whence,
                      fuse_file_info *fi) noexcept nogil
        void (*opendir)(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil
        void (*readdirplus)(fuse_req_t req, fuse_ino_t ino, size_t size, long off,
                            fuse_file_info *fi) noexcept nogil
        void (*releasedir)(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil
        void (*fsyncdir)(fuse_req_t req, fuse_ino_t ino, int datasync,
                         fuse_file_info *fi) noexcept nogil
        void (*statfs)(fuse_req_t req, fuse_ino_t ino) noexcept nogil
        void (*setxattr)(fuse_req_t req, fuse_ino_t ino, const char *name, const char *value,
                         size_t size, int flags) noexcept nogil
        void (*getxattr)(fuse_req_t req, fuse_ino_t ino, const char *name,
                         size_t size) noexcept nogil
        void (*listxattr)(fuse_req_t req, fuse_ino_t ino, size_t size) noexcept nogil
        void (*removexattr)(fuse_req_t req, fuse_ino_t ino, const char *name) noexcept nogil
        void (*access)(fuse_req_t req, fuse_ino_t ino, int mask) noexcept nogil
        void (*create)(fuse_req_t req, fuse_ino_t parent, const char *name, unsigned int mode,
                       fuse_file_info *fi) noexcept nogil

    int FUSE_SET_ATTR_MODE, FUSE_SET_ATTR_UID, FUSE_SET_ATTR_GID, FUSE_SET_ATTR_SIZE
    int FUSE_SET_ATTR_ATIME, FUSE_SET_ATTR_MTIME, FUSE_SET_ATTR_ATIME_NOW
    int FUSE_SET_ATTR_MTIME_NOW, FUSE_SET_ATTR_CTIME

    const fuse_ctx *fuse_req_ctx(fuse_req_t req) nogil
    int fuse_reply_err(fuse_req_t req, int err) nogil
    int fuse_reply_lseek(fuse_req_t req, long off) nogil
    int fuse_lowlevel_notify_inval_inode(fuse_session *se, fuse_ino_t ino, long off,
                                         long length) nogil
    void fuse_reply_none(fuse_req_t req) nogil
    int fuse_reply_entry(fuse_req_t req, const fuse_entry_param *e) nogil
    int fuse_reply_create(fuse_req_t req, const fuse_entry_param *e,
                          const fuse_file_info *fi) nogil
    int fuse_reply_attr(fuse_req_t req, const stat *attr, double attr_timeout) nogil
    int fuse_reply_readlink(fuse_req_t req, const char *link) nogil
    int fuse_reply_open(fuse_req_t req, const fuse_file_info *fi) nogil
    int fuse_reply_write(fuse_req_t req, size_t count) nogil
    int fuse_reply_buf(fuse_req_t req, const char *buf, size_t size) nogil
    int fuse_reply_statfs(fuse_req_t req, const statvfs *stbuf) nogil
    int fuse_reply_xattr(fuse_req_t req, size_t count) nogil
    size_t fuse_add_direntry_plus(fuse_req_t req, char *buf, size_t bufsize, const char *name,
                                  const fuse_entry_param *e, long off) nogil

    fuse_session *fuse_session_new(fuse_args *args, const fuse_lowlevel_ops *op,
                                   size_t op_size, void *userdata)
    int fuse_session_mount(fuse_session *se, const char *mountpoint)
    int fuse_session_loop_mt(fuse_session *se, fuse_loop_config *config) nogil
    void fuse_session_exit(fuse_session *se) nogil
    void fuse_session_unmount(fuse_session *se) nogil
    void fuse_session_destroy(fuse_session *se) nogil
    int fuse_set_signal_handlers(fuse_session *se)
    void fuse_remove_signal_handlers(fuse_session *se)
    fuse_loop_config *fuse_loop_cfg_create()
    void fuse_loop_cfg_destroy(fuse_loop_config *config)
    void fuse_loop_cfg_set_idle_threads(fuse_loop_config *config, unsigned int value)
    void fuse_loop_cfg_set_max_threads(fuse_loop_config *config, unsigned int value)
    void fuse_opt_free_args(fuse_args *args)
    int fuse_opt_add_arg(fuse_args *args, const char *arg)


#: writes at least this long are copied out of libfuse's buffer without the GIL
cdef size_t NOGIL_COPY = 64 << 10
#: large writes are copied into page-aligned arenas (``_iobuf.WriteArenas``): an O_DIRECT
#: flush of them goes to the device straight from there (``DataPath.stage``), so a request's
#: bytes are copied once in the daemon, not twice (into a ``bytes``, then into an aligned
#: staging buffer)
cdef object _arenas = WriteArenas()

cdef object _ops = None           # the handlers (fs.Operations); one session per process
                                  # (``want_acl``, ``init(acl)``: ACLs asked for and granted)
cdef fuse_session *_se = NULL
cdef fuse_lowlevel_ops _llops


# Replies are sent without the GIL: each is a write to /dev/fuse that wakes the caller, whose
# next request another libfuse thread has read by then and waits to run; holding the GIL over
# the write made that thread wait for the system call too.
cdef inline int _rp_err(fuse_req_t req, int err) noexcept:
    cdef int r
    with nogil:
        r = fuse_reply_err(req, err)
    return r


cdef inline void _rp_none(fuse_req_t req) noexcept:
    with nogil:
        fuse_reply_none(req)


cdef inline int _rp_entry(fuse_req_t req, const fuse_entry_param *e) noexcept:
    cdef int r
    with nogil:
        r = fuse_reply_entry(req, e)
    return r


cdef inline int _rp_create(fuse_req_t req, const fuse_entry_param *e,
                           const fuse_file_info *fi) noexcept:
    cdef int r
    with nogil:
        r = fuse_reply_create(req, e, fi)
    return r


cdef inline int _rp_attr(fuse_req_t req, const stat *attr, double timeout) noexcept:
    cdef int r
    with nogil:
        r = fuse_reply_attr(req, attr, timeout)
    return r


cdef inline int _rp_open(fuse_req_t req, const fuse_file_info *fi) noexcept:
    cdef int r
    with nogil:
        r = fuse_reply_open(req, fi)
    return r


cdef inline int _rp_write(fuse_req_t req, size_t count) noexcept:
    cdef int r
    with nogil:
        r = fuse_reply_write(req, count)
    return r


# ---------------------------------------------------------------------------- helpers (GIL held)

cdef int _err(object e, const char *op):
    """The errno for an exception raised by a handler: an ``FsError`` is an answer (not
    logged); another OSError (the device's) is logged and keeps its errno; anything else is
    logged as an internal error and answered EIO."""
    cdef object n = getattr(e, "errno", None)
    if isinstance(e, FsError) and isinstance(n, int) and n > 0:
        return n
    if isinstance(e, OSError):
        log.error("I/O error in %s", op.decode(), exc_info=e)
        return n if isinstance(n, int) and n > 0 else _errno.EIO
    log.error("internal error in %s", op.decode(), exc_info=e)
    return _errno.EIO


cdef object _ctx(fuse_req_t req):
    cdef const fuse_ctx *c = fuse_req_ctx(req)
    return (c.uid, c.gid, c.umask)


cdef void _fill_entry(fuse_entry_param *e, object a, double timeout):
    """An ``Attrs`` (namespace.Attrs) -> fuse_entry_param."""
    memset(e, 0, sizeof(fuse_entry_param))
    cdef long long t
    e.ino = a.ino
    e.generation = 0
    e.entry_timeout = timeout
    e.attr_timeout = timeout
    e.attr.st_ino = a.ino
    e.attr.st_mode = a.mode
    e.attr.st_nlink = a.nlink
    e.attr.st_uid = a.uid
    e.attr.st_gid = a.gid
    e.attr.st_rdev = a.rdev
    e.attr.st_size = a.size
    e.attr.st_blksize = _ops.blksize
    e.attr.st_blocks = ((a.stored if a.stored >= 0 else a.size) + 511) // 512
    t = a.atime
    e.attr.st_atim.tv_sec = t // 1000000000
    e.attr.st_atim.tv_nsec = t % 1000000000
    t = a.mtime
    e.attr.st_mtim.tv_sec = t // 1000000000
    e.attr.st_mtim.tv_nsec = t % 1000000000
    t = a.ctime
    e.attr.st_ctim.tv_sec = t // 1000000000
    e.attr.st_ctim.tv_nsec = t % 1000000000


cdef int _reply_entry(fuse_req_t req, object a):
    cdef fuse_entry_param e
    if a is None:                                 # a miss the kernel caches (negative entry)
        memset(&e, 0, sizeof(e))
        e.entry_timeout = _ops.negative_timeout
        return _rp_entry(req, &e)
    _fill_entry(&e, a, _ops.timeout)
    return _rp_entry(req, &e)


cdef int _reply_attr(fuse_req_t req, object a):
    cdef fuse_entry_param e
    _fill_entry(&e, a, _ops.timeout)
    return _rp_attr(req, &e.attr, e.attr_timeout)


cdef int _reply_bytes(fuse_req_t req, object data):
    """Reply with a buffer's bytes; the copy into the kernel runs without the GIL."""
    cdef Py_buffer pb
    cdef int ret
    PyObject_GetBuffer(data, &pb, PyBUF_SIMPLE)
    try:
        with nogil:
            ret = fuse_reply_buf(req, <const char *>pb.buf, <size_t>pb.len)
    finally:
        PyBuffer_Release(&pb)
    return ret


cdef int _reply_sized(fuse_req_t req, object data, size_t size):
    """getxattr/listxattr: the length when probed with size 0, ERANGE when it does not fit."""
    cdef size_t n = len(data)
    cdef int ret
    if size == 0:
        with nogil:
            ret = fuse_reply_xattr(req, n)
        return ret
    if n > size:
        return _rp_err(req, _errno.ERANGE)
    return _reply_bytes(req, data)


cdef void _answer_ok(fuse_req_t req, const char *op, object fn, tuple args):
    """Run a handler that returns nothing: reply 0, or its errno."""
    try:
        fn(*args)
    except BaseException as exc:
        _rp_err(req, _err(exc, op))
    else:
        _rp_err(req, 0)


cdef void _answer_entry(fuse_req_t req, const char *op, object fn, tuple args):
    """Run a handler that returns an entry (``Attrs``, or None for a cached miss)."""
    try:
        a = fn(*args)
    except BaseException as exc:
        _rp_err(req, _err(exc, op))
    else:
        _reply_entry(req, a)


# ---------------------------------------------------------------------------- handlers (GIL held)

cdef void h_init(void *userdata, fuse_conn_info *conn) noexcept with gil:
    cdef int acl = rz_init_conn(conn, bool(_ops.want_acl))
    try:
        _ops.init(bool(acl))
    except BaseException as exc:
        log.exception("init")


cdef void h_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) noexcept with gil:
    _answer_entry(req, b"lookup", _ops.lookup, (parent, <bytes>name))


cdef void h_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) noexcept with gil:
    try:
        _ops.forget(((ino, nlookup),))
    except BaseException:
        log.exception("forget")
    _rp_none(req)


cdef void h_forget_multi(fuse_req_t req, size_t count, fuse_forget_data *f) noexcept with gil:
    cdef size_t i
    try:
        _ops.forget([(f[i].ino, f[i].nlookup) for i in range(count)])
    except BaseException:
        log.exception("forget")
    _rp_none(req)


cdef void h_getattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept with gil:
    try:
        a = _ops.getattr(ino)
    except BaseException as exc:
        _rp_err(req, _err(exc, b"getattr"))
    else:
        _reply_attr(req, a)


cdef long long _ns(timespec ts) noexcept nogil:
    """A client's time in the int64 nanoseconds the inode record keeps (years 1677..2262).

    Outside that range it is clamped to the nearest end, as the kernel clamps a time to what
    ext4 or XFS can store, instead of wrapping round to a date on the other side of 1970.
    """
    if ts.tv_sec > 9223372035LL:
        return 9223372036854775807LL
    if ts.tv_sec < -9223372036LL:
        return -9223372036854775807LL - 1
    return <long long>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef void h_setattr(fuse_req_t req, fuse_ino_t ino, stat *attr, int to_set,
                     fuse_file_info *fi) noexcept with gil:
    cdef timespec now
    if to_set & (FUSE_SET_ATTR_ATIME_NOW | FUSE_SET_ATTR_MTIME_NOW):
        clock_gettime(CLOCK_REALTIME, &now)
    kw = {}
    if to_set & FUSE_SET_ATTR_MODE:
        kw["mode"] = attr.st_mode
    if to_set & FUSE_SET_ATTR_UID:
        kw["uid"] = attr.st_uid
    if to_set & FUSE_SET_ATTR_GID:
        kw["gid"] = attr.st_gid
    # The kernel sends *_NOW together with ATIME/MTIME and its own coarse clock's time (a
    # jiffy behind): "now" must be this clock's, the one every other timestamp comes from,
    # or `touch` of a file just made sets an mtime before its creation (CPython's
    # test_pathlib test_touch_common).
    if to_set & FUSE_SET_ATTR_ATIME_NOW:
        kw["atime"] = _ns(now)
    elif to_set & FUSE_SET_ATTR_ATIME:
        kw["atime"] = _ns(attr.st_atim)
    if to_set & FUSE_SET_ATTR_MTIME_NOW:
        kw["mtime"] = _ns(now)
    elif to_set & FUSE_SET_ATTR_MTIME:
        kw["mtime"] = _ns(attr.st_mtim)
    if to_set & FUSE_SET_ATTR_CTIME:
        kw["ctime"] = _ns(attr.st_ctim)
    if to_set & FUSE_SET_ATTR_SIZE:
        kw["size"] = attr.st_size
    try:
        a = _ops.setattr(ino, kw)
    except BaseException as exc:
        _rp_err(req, _err(exc, b"setattr"))
    else:
        _reply_attr(req, a)


cdef void h_readlink(fuse_req_t req, fuse_ino_t ino) noexcept with gil:
    cdef bytes target
    cdef const char *t
    try:
        target = bytes(_ops.readlink(ino))
    except BaseException as exc:
        _rp_err(req, _err(exc, b"readlink"))
    else:
        t = target                    # (``target`` keeps the bytes alive over the reply)
        with nogil:
            fuse_reply_readlink(req, t)


cdef void h_mknod(fuse_req_t req, fuse_ino_t parent, const char *name, unsigned int mode,
                   unsigned long rdev) noexcept with gil:
    _answer_entry(req, b"mknod", _ops.mknod, (parent, <bytes>name, mode, rdev, _ctx(req)))


cdef void h_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name,
                   unsigned int mode) noexcept with gil:
    _answer_entry(req, b"mkdir", _ops.mkdir, (parent, <bytes>name, mode, _ctx(req)))


cdef void h_symlink(fuse_req_t req, const char *link, fuse_ino_t parent,
                     const char *name) noexcept with gil:
    _answer_entry(req, b"symlink", _ops.symlink, (parent, <bytes>name, <bytes>link, _ctx(req)))


cdef void h_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent,
                  const char *newname) noexcept with gil:
    _answer_entry(req, b"link", _ops.link, (ino, newparent, <bytes>newname))


cdef void h_unlink(fuse_req_t req, fuse_ino_t parent, const char *name) noexcept with gil:
    _answer_ok(req, b"unlink", _ops.unlink, (parent, <bytes>name))


cdef void h_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name) noexcept with gil:
    _answer_ok(req, b"rmdir", _ops.rmdir, (parent, <bytes>name))


cdef void h_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                    const char *newname, unsigned int flags) noexcept with gil:
    _answer_ok(req, b"rename", _ops.rename,
               (parent, <bytes>name, newparent, <bytes>newname, flags, _ctx(req)))


cdef void h_open(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept with gil:
    try:
        fh, direct_io, keep_cache = _ops.open(ino, fi.flags, _ctx(req))
    except BaseException as exc:
        _rp_err(req, _err(exc, b"open"))
        return
    rz_fi_set(fi, fh, direct_io, keep_cache)
    if _rp_open(req, fi) != 0:          # the opener is gone (interrupted)
        _ops.release(fh)


cdef void h_create(fuse_req_t req, fuse_ino_t parent, const char *name, unsigned int mode,
                    fuse_file_info *fi) noexcept with gil:
    cdef fuse_entry_param e
    try:
        fh, direct_io, keep_cache, a = _ops.create(parent, <bytes>name, mode, fi.flags,
                                                   _ctx(req))
    except BaseException as exc:
        _rp_err(req, _err(exc, b"create"))
        return
    rz_fi_set(fi, fh, direct_io, keep_cache)
    _fill_entry(&e, a, _ops.timeout)
    if _rp_create(req, &e, fi) != 0:
        _ops.release(fh)


cdef void h_read(fuse_req_t req, fuse_ino_t ino, size_t size, long off,
                  fuse_file_info *fi) noexcept with gil:
    try:
        data = _ops.read(fi.fh, off, size)
    except BaseException as exc:
        _rp_err(req, _err(exc, b"read"))
    else:
        _reply_bytes(req, data)


cdef int _copy_into(object dst_obj, const char *src, size_t n) except -1:
    """Copy ``n`` bytes from the kernel's request buffer into a writable buffer nobody else
    sees until the store call, without the GIL (a 1 MiB copy lets other handlers run)."""
    cdef Py_buffer pb
    cdef char *dst
    PyObject_GetBuffer(dst_obj, &pb, PyBUF_WRITABLE)
    dst = <char *>pb.buf
    with nogil:
        memcpy(dst, src, n)
    PyBuffer_Release(&pb)
    return 0


cdef void h_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, long off,
                   fuse_file_info *fi) noexcept with gil:
    cdef char *dst
    cdef size_t r
    try:
        data = _arenas.reserve(ino, off, size)
        if type(data) is tuple:         # the rest of the file's arena, then a new one
            head, tail = data
            r = len(head)
            _copy_into(head, buf, r)
            _copy_into(tail, buf + r, size - r)
            n = _ops.write(fi.fh, off, head)
            if n == r:                  # (short: the device filled within it; reply that)
                try:
                    n += _ops.write(fi.fh, off + r, tail)
                except BaseException:
                    if not n:
                        raise
                    # the first bytes were taken: a short write (the caller retries the rest
                    # and gets the error then), as a file system that fills up midway answers
        else:
            if data is not None:        # a view into the file's write arena
                _copy_into(data, buf, size)
            elif size >= NOGIL_COPY:    # a fresh object: nobody sees it until the call
                data = PyBytes_FromStringAndSize(NULL, size)
                dst = PyBytes_AS_STRING(data)
                with nogil:
                    memcpy(dst, buf, size)
            else:
                data = PyBytes_FromStringAndSize(buf, size)
            n = _ops.write(fi.fh, off, data)
        if fi.flags & O_DSYNC:          # RWF_DSYNC / RWF_SYNC, or an O_DSYNC descriptor
            _ops.write_synced(fi.fh)
    except BaseException as exc:
        _rp_err(req, _err(exc, b"write"))
    else:
        _rp_write(req, n)


cdef void h_flush(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept with gil:
    _arenas.drop(ino)                   # a closed file does not keep its arena
    _answer_ok(req, b"flush", _ops.flush, (fi.fh,))


cdef void h_release(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept with gil:
    _answer_ok(req, b"release", _ops.release, (fi.fh,))


cdef void h_fsync(fuse_req_t req, fuse_ino_t ino, int datasync,
                   fuse_file_info *fi) noexcept with gil:
    _answer_ok(req, b"fsync", _ops.fsync, (fi.fh, datasync != 0))


cdef void h_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, long offset, long length,
                      fuse_file_info *fi) noexcept with gil:
    _answer_ok(req, b"fallocate", _ops.fallocate, (fi.fh, mode, offset, length))


cdef void h_lseek(fuse_req_t req, fuse_ino_t ino, long off, int whence,
                  fuse_file_info *fi) noexcept with gil:
    """SEEK_DATA / SEEK_HOLE.  The kernel asks without writing back pages a shared mapping
    dirtied, so before an answer calls a range a hole, that range of the page cache is
    invalidated: the kernel writes its dirty pages back first (``launder_folio``; WRITE
    requests other threads answer), and the store is asked again.  Without it, bytes stored
    through ``mmap`` and not yet written back were a hole to ``cp`` while ``read`` saw them."""
    cdef long pos = 0, lo, hi
    cdef int tries
    try:
        for tries in range(4):
            pos, lo, hi = _ops.lseek(fi.fh, off, whence)
            if hi == lo:
                break                   # no hole claimed: nothing the kernel could hold
            with nogil:
                fuse_lowlevel_notify_inval_inode(_se, ino, lo, hi - lo if hi > lo else 0)
            npos, nlo, nhi = _ops.lseek(fi.fh, off, whence)
            if (npos, nlo, nhi) == (pos, lo, hi):
                break
            pos = npos
    except BaseException as exc:
        _rp_err(req, _err(exc, b"lseek"))
        return
    if pos < 0:
        _rp_err(req, -pos)
        return
    with nogil:
        fuse_reply_lseek(req, pos)


cdef void h_opendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept with gil:
    try:
        fh = _ops.opendir(ino)
    except BaseException as exc:
        _rp_err(req, _err(exc, b"opendir"))
        return
    rz_fi_set(fi, fh, 0, 0)
    _rp_open(req, fi)


cdef void h_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, long off,
                         fuse_file_info *fi) noexcept with gil:
    """Entries from ``off`` until ``size`` is full; each one but ``.``/``..`` that the reply
    carries is a lookup reference the kernel will FORGET, counted by ``_ops.counted``."""
    cdef char *buf = <char *>calloc(size if size else 1, 1)
    cdef size_t used = 0, n
    cdef fuse_entry_param e
    if buf == NULL:
        _rp_err(req, _errno.ENOMEM)
        return
    try:
        try:
            # an entry takes at least 152 bytes of the reply (fuse_entry_out + fuse_dirent)
            for name, a, cookie in _ops.readdir(fi.fh, off, size // 152 + 2):
                _fill_entry(&e, a, _ops.timeout)
                n = fuse_add_direntry_plus(req, buf + used, size - used,
                                           <const char *><bytes>name, &e, cookie)
                if n > size - used:
                    break
                used += n
                if name != b"." and name != b"..":
                    _ops.counted(a.ino)
        except BaseException as exc:
            _rp_err(req, _err(exc, b"readdir"))
        else:
            with nogil:
                fuse_reply_buf(req, buf, used)
    finally:
        free(buf)


cdef void h_releasedir(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept with gil:
    _answer_ok(req, b"releasedir", _ops.releasedir, (fi.fh,))


cdef void ll_releasedir(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_releasedir(req, ino, fi)


cdef void h_fsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync,
                      fuse_file_info *fi) noexcept with gil:
    _answer_ok(req, b"fsyncdir", _ops.fsyncdir, (fi.fh, datasync != 0))


cdef void h_statfs(fuse_req_t req, fuse_ino_t ino) noexcept with gil:
    cdef statvfs st
    memset(&st, 0, sizeof(st))
    try:
        s = _ops.statfs()
        st.f_bsize = s["bsize"]
        st.f_frsize = s["bsize"]
        st.f_blocks = s["blocks"]
        st.f_bfree = s["bfree"]
        st.f_bavail = s["bfree"]
        st.f_files = s["files"] + s["ffree"]
        st.f_ffree = s["ffree"]
        st.f_favail = s["ffree"]
        st.f_namemax = 255
    except BaseException as exc:
        _rp_err(req, _err(exc, b"statfs"))
        return
    with nogil:
        fuse_reply_statfs(req, &st)


cdef void h_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name, const char *value,
                      size_t size, int flags) noexcept with gil:
    _answer_ok(req, b"setxattr", _ops.setxattr,
               (ino, <bytes>name, PyBytes_FromStringAndSize(value, size), flags))


cdef void h_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name,
                      size_t size) noexcept with gil:
    try:
        v = bytes(_ops.getxattr(ino, <bytes>name))
    except BaseException as exc:
        _rp_err(req, _err(exc, b"getxattr"))
    else:
        _reply_sized(req, v, size)


cdef void h_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size) noexcept with gil:
    try:
        names = _ops.listxattr(ino)
        v = b"".join([bytes(n) + b"\0" for n in names])
    except BaseException as exc:
        _rp_err(req, _err(exc, b"listxattr"))
    else:
        _reply_sized(req, v, size)


cdef void h_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name) noexcept with gil:
    _answer_ok(req, b"removexattr", _ops.removexattr, (ino, <bytes>name))


cdef void h_access(fuse_req_t req, fuse_ino_t ino, int mask) noexcept with gil:
    _answer_ok(req, b"access", _ops.access, (ino, mask))


# ---------------------------------------------------------------------------- entry points (libfuse threads, no GIL)

cdef void ll_init(void *userdata, fuse_conn_info *conn) noexcept nogil:
    rz_attach()
    h_init(userdata, conn)


cdef void ll_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) noexcept nogil:
    rz_attach()
    h_lookup(req, parent, name)


cdef void ll_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) noexcept nogil:
    rz_attach()
    h_forget(req, ino, nlookup)


cdef void ll_forget_multi(fuse_req_t req, size_t count, fuse_forget_data *f) noexcept nogil:
    rz_attach()
    h_forget_multi(req, count, f)


cdef void ll_getattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_getattr(req, ino, fi)


cdef void ll_setattr(fuse_req_t req, fuse_ino_t ino, stat *attr, int to_set,
                     fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_setattr(req, ino, attr, to_set, fi)


cdef void ll_readlink(fuse_req_t req, fuse_ino_t ino) noexcept nogil:
    rz_attach()
    h_readlink(req, ino)


cdef void ll_mknod(fuse_req_t req, fuse_ino_t parent, const char *name, unsigned int mode,
                   unsigned long rdev) noexcept nogil:
    rz_attach()
    h_mknod(req, parent, name, mode, rdev)


cdef void ll_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name,
                   unsigned int mode) noexcept nogil:
    rz_attach()
    h_mkdir(req, parent, name, mode)


cdef void ll_symlink(fuse_req_t req, const char *link, fuse_ino_t parent,
                     const char *name) noexcept nogil:
    rz_attach()
    h_symlink(req, link, parent, name)


cdef void ll_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent,
                  const char *newname) noexcept nogil:
    rz_attach()
    h_link(req, ino, newparent, newname)


cdef void ll_unlink(fuse_req_t req, fuse_ino_t parent, const char *name) noexcept nogil:
    rz_attach()
    h_unlink(req, parent, name)


cdef void ll_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name) noexcept nogil:
    rz_attach()
    h_rmdir(req, parent, name)


cdef void ll_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                    const char *newname, unsigned int flags) noexcept nogil:
    rz_attach()
    h_rename(req, parent, name, newparent, newname, flags)


cdef void ll_open(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_open(req, ino, fi)


cdef void ll_create(fuse_req_t req, fuse_ino_t parent, const char *name, unsigned int mode,
                    fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_create(req, parent, name, mode, fi)


cdef void ll_read(fuse_req_t req, fuse_ino_t ino, size_t size, long off,
                  fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_read(req, ino, size, off, fi)


cdef void ll_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, long off,
                   fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_write(req, ino, buf, size, off, fi)


cdef void ll_flush(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_flush(req, ino, fi)


cdef void ll_release(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_release(req, ino, fi)


cdef void ll_fsync(fuse_req_t req, fuse_ino_t ino, int datasync,
                   fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_fsync(req, ino, datasync, fi)


cdef void ll_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, long offset, long length,
                       fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_fallocate(req, ino, mode, offset, length, fi)


cdef void ll_lseek(fuse_req_t req, fuse_ino_t ino, long off, int whence,
                   fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_lseek(req, ino, off, whence, fi)


cdef void ll_opendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_opendir(req, ino, fi)


cdef void ll_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, long off,
                         fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_readdirplus(req, ino, size, off, fi)


cdef void ll_fsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync,
                      fuse_file_info *fi) noexcept nogil:
    rz_attach()
    h_fsyncdir(req, ino, datasync, fi)


cdef void ll_statfs(fuse_req_t req, fuse_ino_t ino) noexcept nogil:
    rz_attach()
    h_statfs(req, ino)


cdef void ll_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name, const char *value,
                      size_t size, int flags) noexcept nogil:
    rz_attach()
    h_setxattr(req, ino, name, value, size, flags)


cdef void ll_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name,
                      size_t size) noexcept nogil:
    rz_attach()
    h_getxattr(req, ino, name, size)


cdef void ll_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size) noexcept nogil:
    rz_attach()
    h_listxattr(req, ino, size)


cdef void ll_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name) noexcept nogil:
    rz_attach()
    h_removexattr(req, ino, name)


cdef void ll_access(fuse_req_t req, fuse_ino_t ino, int mask) noexcept nogil:
    rz_attach()
    h_access(req, ino, mask)


# ---------------------------------------------------------------------------- the session

_OPS_NEEDED = ("access", "blksize", "counted", "create", "fallocate", "flush", "forget", "fsync",
               "fsyncdir", "getattr", "getxattr", "init", "link", "listxattr", "lookup", "lseek",
               "mkdir", "mknod", "negative_timeout", "open", "opendir", "read", "readdir",
               "readlink", "release", "releasedir", "removexattr", "rename", "rmdir", "setattr",
               "setxattr", "statfs", "symlink", "timeout", "unlink", "want_acl", "write",
               "write_synced")


def mount(ops, str mountpoint, options) -> None:
    """Create the session and mount it (``options``: strings given to libfuse as ``-o``).
    ``ops`` must have the handlers of ``fs.Operations`` and ``blksize``, ``timeout`` and
    ``negative_timeout`` attributes.  Raises RuntimeError when libfuse refuses."""
    global _ops, _se
    if _se != NULL:
        raise RuntimeError("a FUSE session is already mounted in this process")
    # a handler looked up when its request comes would fail outside the handler's try, and
    # that request would never be answered: refuse an incomplete ``ops`` here instead
    lacking = [n for n in _OPS_NEEDED if not hasattr(ops, n)]
    if lacking:
        raise TypeError(f"FUSE ops {type(ops).__name__} lacks {', '.join(lacking)}")
    rz_log_install()
    memset(&_llops, 0, sizeof(_llops))
    _llops.init = ll_init
    _llops.lookup = ll_lookup
    _llops.forget = ll_forget
    _llops.forget_multi = ll_forget_multi
    _llops.getattr = ll_getattr
    _llops.setattr = ll_setattr
    _llops.readlink = ll_readlink
    _llops.mknod = ll_mknod
    _llops.mkdir = ll_mkdir
    _llops.unlink = ll_unlink
    _llops.rmdir = ll_rmdir
    _llops.symlink = ll_symlink
    _llops.rename = ll_rename
    _llops.link = ll_link
    _llops.open = ll_open
    _llops.read = ll_read
    _llops.write = ll_write
    _llops.flush = ll_flush
    _llops.release = ll_release
    _llops.fsync = ll_fsync
    _llops.fallocate = ll_fallocate
    _llops.lseek = ll_lseek
    _llops.opendir = ll_opendir
    _llops.readdirplus = ll_readdirplus
    _llops.releasedir = ll_releasedir
    _llops.fsyncdir = ll_fsyncdir
    _llops.statfs = ll_statfs
    _llops.setxattr = ll_setxattr
    _llops.getxattr = ll_getxattr
    _llops.listxattr = ll_listxattr
    _llops.removexattr = ll_removexattr
    _llops.access = ll_access
    _llops.create = ll_create

    cdef fuse_args args
    args.argc = 0
    args.argv = NULL
    args.allocated = 0
    argv = [b"retainzfs"]
    for o in sorted(options):
        argv += [b"-o", os.fsencode(o)]         # (fsname= is the image's path: any bytes)
    for a in argv:
        if fuse_opt_add_arg(&args, <const char *>a) != 0:
            fuse_opt_free_args(&args)
            raise MemoryError()
    _ops = ops
    se = fuse_session_new(&args, &_llops, sizeof(_llops), NULL)
    fuse_opt_free_args(&args)
    if se == NULL:
        _ops = None
        raise RuntimeError("fuse_session_new() failed (bad FUSE option?)")
    mp = os.fsencode(mountpoint)
    if fuse_session_mount(se, <const char *>mp) != 0:
        fuse_session_destroy(se)
        _ops = None
        raise RuntimeError("fuse_session_mount() failed")
    _se = se


def serve(unsigned int max_threads=64) -> int:
    """Serve requests on libfuse's threads until the file system is unmounted or the process
    gets SIGTERM, SIGINT or SIGHUP (libfuse's C handlers, installed for the call: the calling
    thread sits in C without the GIL, so Python handlers would never run).  Returns 0 after an
    unmount, the signal's number after a signal, or libfuse's negative errno."""
    if _se == NULL:
        raise RuntimeError("not mounted")
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)        # libfuse installs over the default only
    if fuse_set_signal_handlers(_se) != 0:
        raise RuntimeError("fuse_set_signal_handlers() failed")
    cdef fuse_loop_config *cfg = fuse_loop_cfg_create()
    cdef int rc
    # as many idle threads as threads: none exits (each keeps its Python thread state)
    fuse_loop_cfg_set_max_threads(cfg, max_threads)
    fuse_loop_cfg_set_idle_threads(cfg, max_threads)
    try:
        with nogil:
            rc = fuse_session_loop_mt(_se, cfg)
    finally:
        fuse_loop_cfg_destroy(cfg)
        fuse_remove_signal_handlers(_se)
    return rc


def close(bint unmount=True) -> None:
    """Unmount (unless told not to) and free the session."""
    global _se, _ops
    if _se == NULL:
        return
    with nogil:
        if unmount:
            fuse_session_unmount(_se)
        fuse_session_destroy(_se)
        rz_log_flush()
    _se = NULL
    _ops = None
