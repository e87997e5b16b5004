/*
 * fcntl-lock: POSIX record locks from a shell, for the lock tests of
 * qemu-scripts/locks.sh (in the guest and on the host mount).
 *
 *   fcntl-lock try FILE          F_SETLK a write lock on the whole file:
 *                                exit 0 if taken (released at exit),
 *                                1 if another owner holds a lock, 2 else
 *   fcntl-lock wait FILE         F_SETLKW the same: exit 0 once taken
 *   fcntl-lock hold FILE MARKER  F_SETLKW, then create MARKER and hold the
 *                                lock until MARKER is removed
 *   fcntl-lock getlk FILE        F_GETLK for a write lock on the whole
 *                                file: prints "U", or "W START LEN" or
 *                                "R START LEN" for the lock in the way
 *   fcntl-lock flock-try FILE    flock(LOCK_EX | LOCK_NB): exit 0 if
 *                                taken, 1 if held elsewhere, 2 else
 *   fcntl-lock flock-hold FILE MARKER
 *                                flock(LOCK_EX), then as hold
 *
 * (The test guest's busybox has no flock applet.)
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

static int lock(int fd, int cmd, struct flock *fl)
{
	memset(fl, 0, sizeof(*fl));
	fl->l_type = F_WRLCK;
	fl->l_whence = SEEK_SET;
	return fcntl(fd, cmd, fl);
}

int main(int argc, char **argv)
{
	struct flock fl;
	int fd;

	if (argc < 3) {
		fprintf(stderr, "usage: fcntl-lock try|wait|hold|getlk FILE [MARKER]\n");
		return 2;
	}
	fd = open(argv[2], O_RDWR | O_CREAT, 0644);
	if (fd < 0) {
		perror(argv[2]);
		return 2;
	}
	if (!strcmp(argv[1], "try")) {
		if (lock(fd, F_SETLK, &fl) == 0)
			return 0;
		return errno == EAGAIN || errno == EACCES ? 1 : 2;
	}
	if (!strcmp(argv[1], "wait"))
		return lock(fd, F_SETLKW, &fl) == 0 ? 0 : 2;
	if (!strcmp(argv[1], "flock-try")) {
		if (flock(fd, LOCK_EX | LOCK_NB) == 0)
			return 0;
		return errno == EWOULDBLOCK ? 1 : 2;
	}
	if ((!strcmp(argv[1], "hold") || !strcmp(argv[1], "flock-hold")) && argc == 4) {
		int taken = argv[1][0] == 'h' ? lock(fd, F_SETLKW, &fl) : flock(fd, LOCK_EX);

		if (taken != 0)
			return 2;
		close(open(argv[3], O_WRONLY | O_CREAT, 0644));
		while (access(argv[3], F_OK) == 0)
			usleep(100000);
		return 0;
	}
	if (!strcmp(argv[1], "getlk")) {
		if (lock(fd, F_GETLK, &fl) != 0)
			return 2;
		if (fl.l_type == F_UNLCK)
			printf("U\n");
		else
			printf("%c %lld %lld\n", fl.l_type == F_WRLCK ? 'W' : 'R', (long long)fl.l_start,
			       (long long)fl.l_len);
		return 0;
	}
	fprintf(stderr, "fcntl-lock: unknown command %s\n", argv[1]);
	return 2;
}
