/* A file system that stores nothing, in C on libfuse's multi-threaded low-level loop: the
 * other side of scripts/bench_fuse_ceiling.py's pyfuse3 null file system.  Same answers (sizes
 * kept, writes dropped, reads from one static 1 MiB buffer, default_permissions, 1 s
 * timeouts, FOPEN_DIRECT_IO for write-only opens, st_blksize 128 KiB), but every request is
 * received, handled and answered on one of libfuse's threads with no interpreter lock: how
 * far a daemon whose FUSE loop is not pyfuse3's single GIL-holding thread could go here.
 *
 *
 * Given a BACKING directory it stores after all: each file's bytes in BACKING/<inode>, written
 * with pwrite, read with pread (through the host's page cache and its readahead) into a
 * per-request buffer and answered with one copy, fsync as fdatasync.  That is the least any
 * FUSE daemon keeping file data in host files must do, with no placement, journal or checksum:
 * scripts/bench_dcp.py --ceiling measures real DCP loads on it.  With "direct" after BACKING,
 * reads go through a second descriptor opened O_DIRECT (as retainzfs reads its image's zones):
 * what reading past the host's page cache and its readahead costs, alone.
 *
 *   cc -O2 -o nullfs_mt nullfs_mt.c $(pkg-config --cflags --libs fuse3) -lpthread
 *   ./nullfs_mt MOUNTPOINT [BACKING [direct]]  # foreground; prints OK once mounted
 */
#define _GNU_SOURCE                      /* O_DIRECT */
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAXN (1 << 20)
#define REPLY (1 << 20)

struct node {
    mode_t mode;
    off_t size;
    nlink_t nlink;
    fuse_ino_t parent;
    char *name;
    int used;
    fuse_ino_t next;                     /* hash chain of (parent, name) */
    int fd;                              /* BACKING/<inode>, or -1 */
    int rfd;                             /* the same, for reads (O_DIRECT with "direct") */
};

#define HBITS 20
static fuse_ino_t bucket[1 << HBITS];

static unsigned hash(fuse_ino_t parent, const char *name) {
    unsigned long h = 1469598103934665603UL ^ parent;
    for (; *name; name++) h = (h ^ (unsigned char)*name) * 1099511628211UL;
    return (unsigned)(h >> 11) & ((1 << HBITS) - 1);
}

static struct node *nodes;
static fuse_ino_t next_ino = 2;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char *reply_buf;
static struct timespec t0;
static int backing = -1;                 /* the BACKING directory, or -1: store nothing */
static int direct_reads;                 /* "direct": reads with O_DIRECT, as retainzfs's */

static void fill(fuse_ino_t ino, struct stat *st) {
    struct node *n = &nodes[ino];
    memset(st, 0, sizeof(*st));
    st->st_ino = ino;
    st->st_mode = n->mode;
    st->st_nlink = n->nlink;
    st->st_size = n->size;
    st->st_uid = getuid();
    st->st_gid = getgid();
    st->st_blksize = 128 << 10;
    st->st_blocks = (n->size + 511) / 512;
    st->st_atim = st->st_mtim = st->st_ctim = t0;
}

static void entry(fuse_req_t req, fuse_ino_t ino) {
    struct fuse_entry_param e;
    memset(&e, 0, sizeof(e));
    e.ino = ino;
    e.attr_timeout = e.entry_timeout = 1.0;
    if (ino)
        fill(ino, &e.attr);
    fuse_reply_entry(req, &e);
}

static fuse_ino_t find(fuse_ino_t parent, const char *name) {   /* mu held */
    for (fuse_ino_t i = bucket[hash(parent, name)]; i; i = nodes[i].next)
        if (nodes[i].used && nodes[i].parent == parent && !strcmp(nodes[i].name, name))
            return i;
    return 0;
}

static void op_init(void *ud, struct fuse_conn_info *conn) {
    (void)ud;
    conn->max_write = 1 << 20;
    conn->max_readahead = 1 << 20;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    pthread_mutex_lock(&mu);
    fuse_ino_t i = find(parent, name);
    pthread_mutex_unlock(&mu);
    entry(req, i);                       /* ino 0: a negative entry the kernel caches */
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)fi;
    struct stat st;
    if (ino >= next_ino || !nodes[ino].used) { fuse_reply_err(req, ENOENT); return; }
    fill(ino, &st);
    fuse_reply_attr(req, &st, 1.0);
}

static void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set,
                       struct fuse_file_info *fi) {
    (void)fi;
    if (to_set & FUSE_SET_ATTR_SIZE) {
        if (nodes[ino].fd >= 0 && ftruncate(nodes[ino].fd, attr->st_size)) {
            fuse_reply_err(req, errno);
            return;
        }
        nodes[ino].size = attr->st_size;
    }
    if (to_set & FUSE_SET_ATTR_MODE) nodes[ino].mode = (nodes[ino].mode & ~07777) | (attr->st_mode & 07777);
    struct stat st;
    fill(ino, &st);
    fuse_reply_attr(req, &st, 1.0);
}

static fuse_ino_t mk(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode) {
    pthread_mutex_lock(&mu);
    if (find(parent, name)) { pthread_mutex_unlock(&mu); fuse_reply_err(req, EEXIST); return 0; }
    if (next_ino >= MAXN) { pthread_mutex_unlock(&mu); fuse_reply_err(req, ENOSPC); return 0; }
    fuse_ino_t i = next_ino++;
    unsigned h = hash(parent, name);
    nodes[i] = (struct node){mode, 0, S_ISDIR(mode) ? 2 : 1, parent, strdup(name), 1, bucket[h], -1, -1};
    bucket[h] = i;
    if (backing >= 0 && S_ISREG(mode)) {
        char n[32];
        snprintf(n, sizeof(n), "%lu", (unsigned long)i);
        nodes[i].fd = openat(backing, n, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        nodes[i].rfd = direct_reads ? openat(backing, n, O_RDONLY | O_DIRECT | O_CLOEXEC)
                                    : nodes[i].fd;
    }
    pthread_mutex_unlock(&mu);
    return i;
}

static void op_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode) {
    fuse_ino_t i = mk(req, parent, name, S_IFDIR | (mode & 07777 & ~fuse_req_ctx(req)->umask));
    if (i) entry(req, i);
}

static void op_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                      struct fuse_file_info *fi) {
    fuse_ino_t i = mk(req, parent, name, S_IFREG | (mode & 07777 & ~fuse_req_ctx(req)->umask));
    if (!i) return;
    struct fuse_entry_param e;
    memset(&e, 0, sizeof(e));
    e.ino = i;
    e.attr_timeout = e.entry_timeout = 1.0;
    fill(i, &e.attr);
    fi->fh = i;
    fi->direct_io = (fi->flags & O_ACCMODE) == O_WRONLY;
    fuse_reply_create(req, &e, fi);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (fi->flags & O_TRUNC) {
        nodes[ino].size = 0;
        if (nodes[ino].fd >= 0 && ftruncate(nodes[ino].fd, 0)) { fuse_reply_err(req, errno); return; }
    }
    fi->fh = ino;
    fi->keep_cache = 1;
    fi->direct_io = (fi->flags & O_ACCMODE) == O_WRONLY;
    fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi) {
    (void)fi;
    off_t left = nodes[ino].size - off;
    if (left < 0) left = 0;
    if ((off_t)size > left) size = left;
    if (size > REPLY) size = REPLY;
    if (nodes[ino].fd < 0) { fuse_reply_buf(req, reply_buf, size); return; }
    char *buf;
    size_t want = direct_reads ? (size + 4095) & ~(size_t)4095 : size;
    if (posix_memalign((void **)&buf, 4096, want ? want : 4096)) { fuse_reply_err(req, ENOMEM); return; }
    ssize_t got = 0, r = 0;
    while ((size_t)got < size && (r = pread(nodes[ino].rfd, buf + got, want - got, off + got)) > 0)
        got += r;
    if (got > (ssize_t)size) got = size;
    if (got < (ssize_t)size && r < 0) fuse_reply_err(req, errno);
    else fuse_reply_buf(req, buf, got);
    free(buf);
}

static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi) {
    (void)fi;
    if (nodes[ino].fd >= 0) {
        for (size_t done = 0; done < size;) {
            ssize_t r = pwrite(nodes[ino].fd, buf + done, size - done, off + done);
            if (r <= 0) { fuse_reply_err(req, r < 0 ? errno : EIO); return; }
            done += r;
        }
    }
    pthread_mutex_lock(&mu);
    if (off + (off_t)size > nodes[ino].size) nodes[ino].size = off + size;
    pthread_mutex_unlock(&mu);
    fuse_reply_write(req, size);
}

static void op_ok(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino; (void)fi;
    fuse_reply_err(req, 0);
}

static void op_fsync(fuse_req_t req, fuse_ino_t ino, int ds, struct fuse_file_info *fi) {
    (void)ds; (void)fi;
    fuse_reply_err(req, nodes[ino].fd >= 0 && fdatasync(nodes[ino].fd) ? errno : 0);
}

static void drop_bytes(fuse_ino_t i) {          /* mu held; its backing file goes */
    if (nodes[i].fd < 0) return;         /* no open-unlinked files here: the bench closes first */
    char n[32];
    snprintf(n, sizeof(n), "%lu", (unsigned long)i);
    if (nodes[i].rfd != nodes[i].fd) close(nodes[i].rfd);
    close(nodes[i].fd);
    unlinkat(backing, n, 0);
    nodes[i].fd = nodes[i].rfd = -1;
}

static void rm(fuse_req_t req, fuse_ino_t parent, const char *name) {
    pthread_mutex_lock(&mu);
    fuse_ino_t i = find(parent, name);
    if (i) {
        nodes[i].used = 0;               /* stays in its chain, never matched again */
        drop_bytes(i);
    }
    pthread_mutex_unlock(&mu);
    fuse_reply_err(req, i ? 0 : ENOENT);
}

static void unchain(fuse_ino_t i) {                /* mu held */
    fuse_ino_t *p = &bucket[hash(nodes[i].parent, nodes[i].name)];
    while (*p && *p != i) p = &nodes[*p].next;
    if (*p) *p = nodes[i].next;
}

static void op_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                      const char *newname, unsigned int flags) {
    if (flags) { fuse_reply_err(req, EINVAL); return; }
    pthread_mutex_lock(&mu);
    fuse_ino_t i = find(parent, name), j = find(newparent, newname);
    if (!i) { pthread_mutex_unlock(&mu); fuse_reply_err(req, ENOENT); return; }
    if (j && j != i) {                   /* replaced: its bytes go as an unlink's do */
        unchain(j);
        nodes[j].used = 0;
        drop_bytes(j);
    }
    unchain(i);
    free(nodes[i].name);
    nodes[i].name = strdup(newname);
    nodes[i].parent = newparent;
    unsigned h = hash(newparent, newname);
    nodes[i].next = bucket[h];
    bucket[h] = i;
    pthread_mutex_unlock(&mu);
    fuse_reply_err(req, 0);
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    fi->fh = ino;
    fuse_reply_open(req, fi);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi) {
    (void)fi;
    char *buf = malloc(size);
    size_t pos = 0;
    struct stat st;
    pthread_mutex_lock(&mu);
    for (fuse_ino_t i = off + 2; i < next_ino; i++) {
        if (!nodes[i].used || nodes[i].parent != ino) continue;
        fill(i, &st);
        size_t n = fuse_add_direntry(req, buf + pos, size - pos, nodes[i].name, &st, i - 1);
        if (n > size - pos) break;
        pos += n;
    }
    pthread_mutex_unlock(&mu);
    fuse_reply_buf(req, buf, pos);
    free(buf);
}

static void op_statfs(fuse_req_t req, fuse_ino_t ino) {
    (void)ino;
    struct statvfs s;
    memset(&s, 0, sizeof(s));
    s.f_bsize = s.f_frsize = 4096;
    s.f_blocks = s.f_bfree = s.f_bavail = 1 << 30;
    s.f_files = s.f_ffree = s.f_favail = MAXN;
    s.f_namemax = 255;
    fuse_reply_statfs(req, &s);
}

static const struct fuse_lowlevel_ops ops = {
    .init = op_init, .lookup = op_lookup, .getattr = op_getattr, .setattr = op_setattr,
    .mkdir = op_mkdir, .create = op_create, .open = op_open, .read = op_read,
    .write = op_write, .flush = op_ok, .release = op_ok, .fsync = op_fsync,
    .unlink = rm, .rmdir = rm, .rename = op_rename, .opendir = op_opendir, .readdir = op_readdir,
    .releasedir = op_ok, .statfs = op_statfs,
};

int main(int argc, char **argv) {
    if (argc < 2 || argc > 4 || (argc == 4 && strcmp(argv[3], "direct"))) {
        fprintf(stderr, "usage: %s MOUNTPOINT [BACKING [direct]]\n", argv[0]);
        return 2;
    }
    direct_reads = argc == 4;
    if (argc >= 3 && (backing = open(argv[2], O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
        perror(argv[2]);
        return 1;
    }
    nodes = calloc(MAXN, sizeof(*nodes));
    reply_buf = malloc(REPLY);
    for (int i = 0; i < REPLY; i++) reply_buf[i] = (char)i;
    clock_gettime(CLOCK_REALTIME, &t0);
    nodes[1] = (struct node){S_IFDIR | 0755, 0, 2, 0, strdup(""), 1, 0, -1, -1};
    char *fargv[] = {argv[0], "-o", "default_permissions,fsname=nullfs_mt,subtype=nullfs", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
    if (!se || fuse_set_signal_handlers(se) || fuse_session_mount(se, argv[1])) return 1;
    printf("OK\n");
    fflush(stdout);
    struct fuse_loop_config cfg = {.clone_fd = 0, .max_idle_threads = 16};
    int rc = fuse_session_loop_mt(se, &cfg);
    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return rc ? 1 : 0;
}
