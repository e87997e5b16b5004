/*
 * dirloop: lists one directory over and over through a single open
 * descriptor, for the live-migration guest test (guest-tests/migrate.sh,
 * put in the guest by qemu-scripts/migrate.sh).
 *
 *   dirloop DIR|FD WANT STOPFILE
 *
 * DIR is opened once (O_RDONLY | O_DIRECTORY); a number FD names a
 * descriptor inherited from the shell instead (`exec 4</mnt/dir; dirloop 4
 * ...`), so the shell and dirloop share one open directory: one FUSE
 * directory handle, which must survive a migration to another keelfsd.
 * Each pass rewinds it (lseek 0) and reads it to the end with getdents64;
 * every pass must see WANT entries besides "." and "..". When STOPFILE
 * exists, prints "dirloop: N passes" and exits 0; a failed call or a
 * different count prints what and where and exits 1.
 *
 * Build: cc -O2 -Wall -o dirloop dirloop.c
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: dirloop DIR|FD WANT STOPFILE\n");
		return 2;
	}
	const char *what = argv[1];
	char *end;
	long want = strtol(argv[2], &end, 10);
	if (*end || want < 0) {
		fprintf(stderr, "dirloop: WANT '%s' is not a count\n", argv[2]);
		return 2;
	}
	const char *stop = argv[3];
	long n = strtol(what, &end, 10);
	int fd = (*what && !*end) ? (int)n : open(what, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0) {
		fprintf(stderr, "dirloop: open %s: %s\n", what, strerror(errno));
		return 1;
	}
	static char buf[32768];
	unsigned long pass = 0;
	time_t t0 = time(NULL);
	for (;;) {
		if (access(stop, F_OK) == 0)
			break;
		if (lseek(fd, 0, SEEK_SET) != 0) {
			fprintf(stderr, "dirloop: pass %lu (%lds): lseek %s: %s\n", pass,
				(long)(time(NULL) - t0), what, strerror(errno));
			return 1;
		}
		long count = 0;
		for (;;) {
			long got = syscall(SYS_getdents64, fd, buf, sizeof buf);
			if (got < 0) {
				fprintf(stderr, "dirloop: pass %lu (%lds): getdents64 %s: %s\n", pass,
					(long)(time(NULL) - t0), what, strerror(errno));
				return 1;
			}
			if (got == 0)
				break;
			for (long off = 0; off < got;) {
				struct dirent64 *d = (struct dirent64 *)(buf + off);
				if (strcmp(d->d_name, ".") && strcmp(d->d_name, ".."))
					count++;
				off += d->d_reclen;
			}
		}
		if (count != want) {
			fprintf(stderr, "dirloop: pass %lu (%lds): %ld entries in %s, want %ld\n", pass,
				(long)(time(NULL) - t0), count, what, want);
			return 1;
		}
		pass++;
	}
	printf("dirloop: %lu passes over %s in %lds, %ld entries each\n", pass, what,
	       (long)(time(NULL) - t0), want);
	return 0;
}
