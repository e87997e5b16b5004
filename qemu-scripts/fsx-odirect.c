/*
 * LD_PRELOAD shim that gives fsx (the Rust crate, which has no O_DIRECT
 * option) an O_DIRECT mode: open()/open64()/openat() of the path named by
 * $FSX_ODIRECT_PATH get O_DIRECT added. Other paths (fsx's log and good-file
 * artifacts) are left alone. At exit it prints how many opens it changed, so
 * a test can check that the mode was really in effect.
 *
 * build-guest.sh compiles it into the guest as /usr/lib/fsx-odirect.so:
 *   cc -shared -fPIC -O2 -o fsx-odirect.so fsx-odirect.c -ldl
 * Use: FSX_ODIRECT_PATH=/mnt/f LD_PRELOAD=/usr/lib/fsx-odirect.so fsx ... /mnt/f
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned long changed;

static int wants_direct(const char *path)
{
	const char *want = getenv("FSX_ODIRECT_PATH");
	return want && path && strcmp(path, want) == 0;
}

static int adjust(const char *path, int flags)
{
	if (wants_direct(path)) {
		changed++;
		flags |= O_DIRECT;
	}
	return flags;
}

#define MODE_ARG(flags, mode)                                   \
	do {                                                    \
		if ((flags) & (O_CREAT | __O_TMPFILE)) {        \
			va_list ap;                             \
			va_start(ap, flags);                    \
			mode = va_arg(ap, int);                 \
			va_end(ap);                             \
		}                                               \
	} while (0)

int open(const char *path, int flags, ...)
{
	static int (*next)(const char *, int, ...);
	int mode = 0;
	MODE_ARG(flags, mode);
	if (!next)
		next = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, "open");
	return next(path, adjust(path, flags), mode);
}

int open64(const char *path, int flags, ...)
{
	static int (*next)(const char *, int, ...);
	int mode = 0;
	MODE_ARG(flags, mode);
	if (!next)
		next = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, "open64");
	return next(path, adjust(path, flags), mode);
}

int openat(int dirfd, const char *path, int flags, ...)
{
	static int (*next)(int, const char *, int, ...);
	int mode = 0;
	MODE_ARG(flags, mode);
	if (!next)
		next = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, "openat");
	return next(dirfd, path, adjust(path, flags), mode);
}

__attribute__((destructor)) static void report(void)
{
	if (getenv("FSX_ODIRECT_PATH"))
		fprintf(stderr, "fsx-odirect: %lu open(s) of %s with O_DIRECT\n", changed,
			getenv("FSX_ODIRECT_PATH"));
}
