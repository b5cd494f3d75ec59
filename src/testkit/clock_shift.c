/* Shifts the wall clock of the process it is preloaded into (LD_PRELOAD) by a number of
 * microseconds read from the file named by PACER_CLOCK_SHIFT_FILE, re-read at most every 5 ms,
 * so a test steps the clock by rewriting the file. CLOCK_REALTIME (and gettimeofday, time) only:
 * the monotonic clock runs on, as it does when an operator or NTP steps a real clock.
 * libfaketime does this too, but Debian's redis-server 7.0 cannot start under it ("unexpected
 * recursive calls to clock_gettime"): this shim reads the kernel's clock with a raw syscall and
 * calls nothing that reads the clock. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long shift_us(void) {
    static long long cached, checked_ns;
    static const char *path;
    struct timespec m;
    syscall(SYS_clock_gettime, CLOCK_MONOTONIC, &m);
    long long now_ns = (long long)m.tv_sec * 1000000000LL + m.tv_nsec;
    if (!path) path = getenv("PACER_CLOCK_SHIFT_FILE");
    if (path && (checked_ns == 0 || now_ns - checked_ns > 5000000LL)) {
        checked_ns = now_ns;
        int fd = open(path, O_RDONLY);
        if (fd >= 0) {
            char b[32];
            ssize_t n = read(fd, b, sizeof b - 1);
            close(fd);
            if (n > 0) {
                b[n] = 0;
                cached = atoll(b);
            }
        }
    }
    return cached;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    int r = (int)syscall(SYS_clock_gettime, clock, ts);
    if (r == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + shift_us() * 1000LL;
        ts->tv_sec = ns / 1000000000LL;
        ts->tv_nsec = ns % 1000000000LL;
    }
    return r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    (void)tz;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
