/*
 * smallfiles: one small-file phase over N files in DIR, timed with the
 * guest's monotonic clock, for bench/run-guest-smallfiles.sh.
 *
 *   smallfiles DIR N create|stat|read|unlink [SIZE]
 *
 * create writes SIZE bytes (default 4096) to DIR/f<i> (O_CREAT|O_EXCL);
 * stat stats each; read opens, reads to the end and closes each; unlink
 * removes each. Prints "smallfiles PHASE N NS" and exits 0, or names the
 * failed call and file and exits 1. DIR must exist.
 *
 * Build: cc -O2 -Wall -o smallfiles smallfiles.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SIZE_MAX_BYTES (1 << 20)

static char buf[SIZE_MAX_BYTES];

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int fail(const char *call, const char *path)
{
	fprintf(stderr, "smallfiles: %s %s: %s\n", call, path, strerror(errno));
	return 1;
}

static int one(const char *phase, const char *path, long size)
{
	struct stat st;
	int fd;
	ssize_t n;

	if (strcmp(phase, "create") == 0) {
		fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
		if (fd < 0)
			return fail("open", path);
		if (write(fd, buf, size) != size)
			return fail("write", path);
		return close(fd) ? fail("close", path) : 0;
	}
	if (strcmp(phase, "stat") == 0)
		return stat(path, &st) ? fail("stat", path) : 0;
	if (strcmp(phase, "read") == 0) {
		fd = open(path, O_RDONLY);
		if (fd < 0)
			return fail("open", path);
		while ((n = read(fd, buf, sizeof(buf))) > 0)
			;
		if (n < 0)
			return fail("read", path);
		return close(fd) ? fail("close", path) : 0;
	}
	if (strcmp(phase, "unlink") == 0)
		return unlink(path) ? fail("unlink", path) : 0;
	fprintf(stderr, "smallfiles: unknown phase %s\n", phase);
	return 2;
}

int main(int argc, char **argv)
{
	char path[4096];
	long n, size = 4096, i;
	long long start;

	if (argc < 4 || argc > 5) {
		fprintf(stderr, "usage: smallfiles DIR N create|stat|read|unlink [SIZE]\n");
		return 2;
	}
	n = atol(argv[2]);
	if (argc == 5)
		size = atol(argv[4]);
	if (n <= 0 || n > 10000000 || size < 0 || size > SIZE_MAX_BYTES) {
		fprintf(stderr, "smallfiles: N or SIZE out of range\n");
		return 2;
	}
	memset(buf, 'k', sizeof(buf));
	start = now_ns();
	for (i = 0; i < n; i++) {
		int rc;

		snprintf(path, sizeof(path), "%s/f%ld", argv[1], i);
		rc = one(argv[3], path, size);
		if (rc)
			return rc;
	}
	printf("smallfiles %s %ld %lld\n", argv[3], n, now_ns() - start);
	return 0;
}
