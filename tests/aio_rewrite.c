/* aio_rewrite FILE SECONDS: rewrite FILE (640 KiB) with two patterns in turn by Linux AIO
 * with O_DIRECT, each write checked by a buffered read (a new descriptor) once it completed;
 * prints "CYCLES cycles STALE stale".  With readers of the file running beside it, a FUSE
 * mount with async direct I/O served the old pattern from the page cache (xfstests'
 * generic/451, tests/test_regressions.py).  Raw syscalls: no libaio needed. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define N 655360

int main(int argc, char **argv)
{
    const char *path = argv[1];
    double secs = atof(argv[2]);
    char *buf[2], *got = malloc(N);
    aio_context_t ctx = 0;
    struct timespec t0, t;
    long cycles = 0, stale = 0;
    int fd = open(path, O_RDWR | O_DIRECT | O_CREAT, 0644);
    if (fd < 0 || syscall(SYS_io_setup, 1, &ctx) < 0) { perror("setup"); return 2; }
    for (int i = 0; i < 2; i++) {
        if (posix_memalign((void **)&buf[i], 4096, N)) return 2;
        memset(buf[i], i ? 0x55 : 0xaa, N);
    }
    if (pwrite(fd, buf[0], N, 0) != N || fsync(fd)) { perror("pwrite"); return 2; }
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        struct iocb cb = {0}, *cbs[1] = {&cb};
        struct io_event ev;
        char *want = buf[++cycles % 2];
        cb.aio_fildes = fd;
        cb.aio_lio_opcode = IOCB_CMD_PWRITE;
        cb.aio_buf = (uint64_t)(uintptr_t)want;
        cb.aio_nbytes = N;
        if (syscall(SYS_io_submit, ctx, 1, cbs) != 1 ||
            syscall(SYS_io_getevents, ctx, 1, 1, &ev, NULL) != 1 || ev.res != N) {
            perror("aio write"); return 2;
        }
        int r = open(path, O_RDONLY);
        if (r < 0 || pread(r, got, N, 0) != N) { perror("pread"); return 2; }
        close(r);
        stale += memcmp(got, want, N) != 0;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while (t.tv_sec - t0.tv_sec + (t.tv_nsec - t0.tv_nsec) / 1e9 < secs);
    printf("%ld cycles %ld stale\n", cycles, stale);
    return 0;
}
