// forkvm-zygote.so: QEMU as a fork server (engine Config.ZygoteShim).
//
// A QEMU started with this library in LD_PRELOAD and FORKVM_ZYGOTE_FD=N stops short of
// its main: the dynamic linker has relocated its ~50 libraries and their constructors
// have run, and QEMU's main has not. It then serves the engine on the SOCK_SEQPACKET
// socket N. Each request is one message: the working directory and QEMU's arguments,
// NUL-terminated, and one file descriptor (SCM_RIGHTS) for the new QEMU's stdout and
// stderr. The zygote forks (glibc's fork, so that QEMU's own fork handlers run: its RCU
// thread is made again in the child), the child forks the QEMU and exits, so the QEMU
// is handed to the engine, a child subreaper (PR_SET_CHILD_SUBREAPER), as its own child,
// and the zygote answers "pid N" or "err ERRNO" once that child has exited. The QEMU
// starts a session of its own, enters the directory, gets /dev/null as stdin and the
// descriptor as stdout and stderr, closes every other descriptor, under TCG turns
// transparent huge pages off for itself (PR_SET_THP_DISABLE), and runs QEMU's main with
// the arguments. The pages the libraries' relocations wrote stay shared, copy on
// write, with the zygote and every other QEMU it forked. When the engine's end of the
// socket closes, the zygote exits. Its first message says it is ready.
//
// A forked QEMU's /proc/PID/cmdline is the memory its zygote was executed with: the
// engine pads that with a long argument, and each QEMU writes its own arguments over
// it, so that what reads a process's command line (admission's scan of the host's
// QEMUs, ps) sees them. The zygote shows itself as "ARGV0 forkvm-zygote".
//
// Without FORKVM_ZYGOTE_FD the library does nothing: QEMU's main runs as usual.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int (*main_fn)(int, char **, char **);

static main_fn real_main;

// cmdline is the memory of the zygote's arguments (/proc/PID/cmdline), cmdline_len long.
static char *cmdline;
static size_t cmdline_len;

// request_max bounds one request: QEMU's arguments and the directory.
#define request_max (256 * 1024)
// args_max bounds QEMU's arguments.
#define args_max 4096

static void reply(int sock, const char *msg) {
	while (send(sock, msg, strlen(msg), MSG_NOSIGNAL) < 0 && errno == EINTR) {
	}
}

// close_from closes every descriptor from lowest up.
static void close_from(int lowest) {
#ifdef SYS_close_range
	if (syscall(SYS_close_range, lowest, ~0U, 0) == 0) {
		return;
	}
#endif
	long max = sysconf(_SC_OPEN_MAX);
	for (long fd = lowest; fd < max; fd++) {
		close((int)fd);
	}
}

// show_args writes args over cmdline, NUL-separated, the rest NUL (cut short where they
// do not fit).
static void show_args(int argc, char **args) {
	if (cmdline == NULL || cmdline_len == 0) {
		return;
	}
	size_t off = 0;
	for (int i = 0; i < argc && off < cmdline_len; i++) {
		size_t n = strlen(args[i]) + 1;
		if (n > cmdline_len - off) {
			n = cmdline_len - off;
		}
		memmove(cmdline + off, args[i], n);
		off += n;
	}
	memset(cmdline + off, 0, cmdline_len - off);
	cmdline[cmdline_len - 1] = 0;
}

// become_qemu readies the forked child to run QEMU's main: a session of its own, dir,
// /dev/null, out as stdout and stderr, nothing else open.
static int become_qemu(const char *dir, int out) {
	if (setsid() < 0) {
		return -1;
	}
	if (dir[0] != 0 && chdir(dir) < 0) {
		return -1;
	}
	int null = open("/dev/null", O_RDONLY);
	if (null < 0 || dup2(null, 0) < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0) {
		return -1;
	}
	close_from(3);
	return 0;
}

// runs_tcg reports whether args ask for TCG (-accel tcg...), as the engine writes them.
static int runs_tcg(int argc, char **args) {
	for (int i = 1; i + 1 < argc; i++) {
		if (strcmp(args[i], "-accel") == 0 && strncmp(args[i + 1], "tcg", 3) == 0 &&
				(args[i + 1][3] == 0 || args[i + 1][3] == ',')) {
			return 1;
		}
	}
	return 0;
}

// fork_qemu forks the QEMU that runs real_main with args in dir, out its stdout and
// stderr, through a middle child that exits at once, so that the QEMU is the
// subreaper's child: its pid, or -errno.
static int fork_qemu(const char *dir, int out, int argc, char **args, char **envp) {
	int pipefd[2];
	if (pipe2(pipefd, O_CLOEXEC) < 0) {
		return -errno;
	}
	pid_t mid = fork();
	if (mid == 0) {
		close(pipefd[0]);
		pid_t q = fork();
		if (q == 0) {
			if (become_qemu(dir, out) < 0) {
				_exit(127);
			}
			// Under TCG, no transparent huge pages: QEMU asks them for its translation
			// buffer (MADV_HUGEPAGE), so each region a vCPU translates into takes 2
			// MiB at its first write, zeroed in the fault and compacted for. It
			// covers the whole QEMU: a VM's anonymous guest RAM (not a fork's RAM
			// file) gets none either.
			if (runs_tcg(argc, args)) {
				prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
			}
			show_args(argc, args);
			exit(real_main(argc, args, envp));
		}
		int r = q > 0 ? q : -errno;
		ssize_t w = write(pipefd[1], &r, sizeof r);
		_exit(w == sizeof r ? 0 : 1);
	}
	int r = mid < 0 ? -errno : -EIO;
	close(pipefd[1]);
	if (mid > 0) {
		ssize_t got;
		while ((got = read(pipefd[0], &r, sizeof r)) < 0 && errno == EINTR) {
		}
		if (got != sizeof r) {
			r = -EIO;
		}
		// Once the middle child is gone, the QEMU is the subreaper's.
		while (waitpid(mid, NULL, 0) < 0 && errno == EINTR) {
		}
	}
	close(pipefd[0]);
	return r;
}

// serve answers requests on sock until the engine closes it. Its first message,
// "ready", tells the engine the library runs.
static int serve(int sock, char *argv0, char **envp) {
	static char buf[request_max];
	// argv0 lives in cmdline, which each QEMU writes over: a copy of it.
	static char argv0copy[4096];
	snprintf(argv0copy, sizeof argv0copy, "%s", argv0);
	char *shown[] = {argv0copy, "forkvm-zygote"};
	show_args(2, shown);
	prctl(PR_SET_NAME, "forkvm-zygote", 0, 0, 0);
	reply(sock, "ready");
	for (;;) {
		char cbuf[CMSG_SPACE(sizeof(int))];
		struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf - 1};
		struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
		ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
		if (n < 0 && errno == EINTR) {
			continue;
		}
		if (n <= 0) {
			return 0; // the engine is gone
		}
		int out = -1;
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		if (c != NULL && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int))) {
			memcpy(&out, CMSG_DATA(c), sizeof out);
		}
		if (out < 0 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || buf[n - 1] != 0) {
			if (out >= 0) {
				close(out);
			}
			reply(sock, "err 22"); // EINVAL: a request the engine never sends
			continue;
		}
		buf[n] = 0;
		// buf: dir NUL arg NUL arg NUL ...
		static char *args[args_max + 2];
		int argc = 0;
		args[argc++] = argv0copy;
		const char *dir = buf;
		for (char *p = buf + strlen(buf) + 1; p < buf + n && argc <= args_max; p += strlen(p) + 1) {
			args[argc++] = p;
		}
		args[argc] = NULL;

		int r = fork_qemu(dir, out, argc, args, envp);
		close(out);
		char m[32];
		if (r > 0) {
			snprintf(m, sizeof m, "pid %d", r);
		} else {
			snprintf(m, sizeof m, "err %d", -r);
		}
		reply(sock, m);
	}
}

static int main_hook(int argc, char **argv, char **envp) {
	const char *fdenv = getenv("FORKVM_ZYGOTE_FD");
	if (fdenv == NULL) {
		return real_main(argc, argv, envp);
	}
	int sock = atoi(fdenv);
	unsetenv("FORKVM_ZYGOTE_FD");
	unsetenv("LD_PRELOAD");
	if (sock < 3 || fcntl(sock, F_SETFD, FD_CLOEXEC) < 0) {
		fprintf(stderr, "forkvm-zygote: bad FORKVM_ZYGOTE_FD %s\n", fdenv);
		return 1;
	}
	cmdline = argv[0];
	cmdline_len = (size_t)(argv[argc - 1] + strlen(argv[argc - 1]) + 1 - argv[0]);
	return serve(sock, argv[0], environ);
}

// __libc_start_main is glibc's: it runs the constructors, then main. This one hands it
// main_hook for QEMU's main.
int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void), void (*fini)(void),
		void (*rtld_fini)(void), void *stack_end) {
	int (*next)(main_fn, int, char **, void (*)(void), void (*)(void), void (*)(void), void *) =
		(int (*)(main_fn, int, char **, void (*)(void), void (*)(void), void (*)(void), void *))dlsym(RTLD_NEXT, "__libc_start_main");
	real_main = main;
	return next(main_hook, argc, argv, init, fini, rtld_fini, stack_end);
}
