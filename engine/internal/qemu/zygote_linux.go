//go:build linux

package qemu

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Zygote is one QEMU binary started as a fork server (zygote/zygote.c, preloaded from
// the shim library): its libraries are relocated once, and every QEMU it forks shares
// the relocated pages copy on write and skips the dynamic linker's work. The QEMUs it
// forks are this process's children (it is made a child subreaper), so Spawn watches
// and reaps them as it does the ones it executes.
//
// Concurrency: Spawn may be called from many goroutines; requests are answered one at
// a time.
type Zygote struct {
	binary string
	exe    os.FileInfo // the file the zygote runs (nil: unknown)

	mu     sync.Mutex
	conn   *net.UnixConn
	cmd    *exec.Cmd
	closed bool
	// broken is why the socket can no longer be trusted (an answer that did not come
	// in time may still come, as the answer to the next request): every fork fails.
	broken error
	// answerTimeout bounds the wait for an answer, closeWait the zygote's exit after
	// its socket closed (then it is killed): zygoteAnswerTimeout, zygoteCloseWait.
	answerTimeout, closeWait time.Duration
}

// zygoteAnswerTimeout bounds the wait for a zygote's answer: it forks twice and
// answers once the middle child exited, milliseconds even on a loaded host. A zygote
// that does not answer (stopped, say) must not hold every spawn of its binary.
const zygoteAnswerTimeout = 30 * time.Second

// zygoteCloseWait is how long Close waits for the zygote to exit on its socket's end
// before it kills it.
const zygoteCloseWait = 5 * time.Second

// subreaperOnce makes the process a child subreaper once: a QEMU whose forking parent
// exits is handed to it. Process-wide and kept (zygotes' QEMUs outlive their zygote).
var subreaperOnce = sync.OnceValue(func() error {
	return unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
})

// ErrZygote is the error (in a *StartError) of a zygote that does not start or no
// longer answers: its QEMUs are executed instead (the engine drops it).
var ErrZygote = errors.New("qemu zygote")

// zygoteCmdlineRoom is the room for a forked QEMU's arguments in its command line.
const zygoteCmdlineRoom = 64 << 10

// zygoteReadyWait bounds the wait for a new zygote's "ready".
const zygoteReadyWait = 30 * time.Second

// StartZygote starts binary as a zygote with the shim library preloaded and waits until
// it says it is ready. It fails with a *StartError wrapping ErrZygote when the zygote
// cannot be started or does not answer as one (a shim that was not loaded).
func StartZygote(binary, shim string) (*Zygote, error) {
	if err := subreaperOnce(); err != nil {
		return nil, &StartError{Err: fmt.Errorf("%w: child subreaper: %w", ErrZygote, err)}
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, &StartError{Err: fmt.Errorf("%w: socketpair: %w", ErrZygote, err)}
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "zygote"), os.NewFile(uintptr(fds[1]), "zygote-child")
	// -version: a QEMU whose shim was not loaded prints its version and exits, so its
	// start fails at once instead of running a default machine. The padding is the room
	// each forked QEMU writes its arguments into (/proc/PID/cmdline).
	cmd := exec.Command(binary, "-version", strings.Repeat("-", zygoteCmdlineRoom))
	cmd.Env = append(os.Environ(), "LD_PRELOAD="+shim, "FORKVM_ZYGOTE_FD=3")
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	theirs.Close() // the zygote's now: its exit is our EOF
	if err != nil {
		ours.Close()
		return nil, &StartError{Err: fmt.Errorf("%w: %w", ErrZygote, err)}
	}
	fc, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, &StartError{Err: fmt.Errorf("%w: %w", ErrZygote, err)}
	}
	z := &Zygote{binary: binary, conn: fc.(*net.UnixConn), cmd: cmd}
	buf := make([]byte, 16)
	z.conn.SetReadDeadline(time.Now().Add(zygoteReadyWait))
	n, err := z.conn.Read(buf)
	z.conn.SetReadDeadline(time.Time{})
	if err != nil || string(buf[:n]) != "ready" {
		z.conn.Close()
		cmd.Process.Kill()
		cmd.Wait()
		if err == nil {
			err = fmt.Errorf("answered %q", buf[:n])
		}
		return nil, &StartError{Err: fmt.Errorf("%w: %s with %s is not ready: %w", ErrZygote, binary, shim, err)}
	}
	// The file it runs, even once replaced on disk (an upgrade) or deleted.
	z.exe, _ = os.Stat("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/exe")
	return z, nil
}

// Binary is the QEMU binary the zygote forks.
func (z *Zygote) Binary() string { return z.binary }

// Current reports whether Binary still names the file the zygote runs: false once the
// binary was replaced on disk (a package upgrade), whose QEMUs the zygote would go on
// forking from the old one. True where that is not known (the binary missing, say).
func (z *Zygote) Current() bool {
	if z.exe == nil {
		return true
	}
	fi, err := os.Stat(z.binary)
	return err != nil || os.SameFile(fi, z.exe)
}

// errZygoteClosed is the error of a Spawn through a closed zygote.
var errZygoteClosed = fmt.Errorf("%w closed", ErrZygote)

// fork asks the zygote for one QEMU with args (argv without argv[0]) in dir, its stdout
// and stderr on out, and returns its pid: a child of this process.
func (z *Zygote) fork(args []string, dir string, out *os.File) (int, error) {
	var req bytes.Buffer
	req.WriteString(dir)
	req.WriteByte(0)
	for _, a := range args {
		if strings.IndexByte(a, 0) >= 0 {
			return 0, fmt.Errorf("%w: an argument with a NUL byte", ErrZygote)
		}
		req.WriteString(a)
		req.WriteByte(0)
	}
	z.mu.Lock()
	defer z.mu.Unlock()
	switch {
	case z.closed:
		return 0, errZygoteClosed
	case z.broken != nil:
		return 0, z.broken
	}
	timeout := cmp.Or(z.answerTimeout, zygoteAnswerTimeout)
	if err := z.conn.SetDeadline(time.Now().Add(timeout)); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrZygote, err)
	}
	if _, _, err := z.conn.WriteMsgUnix(req.Bytes(), unix.UnixRights(int(out.Fd())), nil); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			z.broken = fmt.Errorf("%w: its socket took no request in %v", ErrZygote, timeout)
			return 0, z.broken
		}
		return 0, fmt.Errorf("%w: request: %w", ErrZygote, err)
	}
	buf := make([]byte, 64)
	n, err := z.conn.Read(buf)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		z.broken = fmt.Errorf("%w: no answer in %v", ErrZygote, timeout)
		return 0, z.broken
	}
	if err != nil {
		return 0, fmt.Errorf("%w: answer: %w", ErrZygote, err)
	}
	return parseZygoteAnswer(string(buf[:n]))
}

// parseZygoteAnswer reads the zygote's "pid N" or "err ERRNO".
func parseZygoteAnswer(s string) (int, error) {
	kind, num, ok := strings.Cut(s, " ")
	v, err := strconv.Atoi(num)
	switch {
	case !ok || err != nil || v <= 0:
		return 0, fmt.Errorf("%w: bad answer %q", ErrZygote, s)
	case kind == "pid":
		return v, nil
	case kind == "err":
		return 0, fmt.Errorf("%w: fork: %w", ErrZygote, syscall.Errno(v))
	}
	return 0, fmt.Errorf("%w: bad answer %q", ErrZygote, s)
}

// Close ends the zygote (its end of the socket sees EOF) and reaps it, killing it if it
// does not exit (a stopped zygote). The QEMUs it forked go on.
func (z *Zygote) Close() error {
	z.mu.Lock()
	if z.closed || z.conn == nil { // nil: a zero Zygote, none started
		z.mu.Unlock()
		return nil
	}
	z.closed = true
	err := z.conn.Close()
	z.mu.Unlock()
	exited := make(chan struct{})
	go func() {
		z.cmd.Wait()
		close(exited)
	}()
	select {
	case <-exited:
	case <-time.After(cmp.Or(z.closeWait, zygoteCloseWait)):
		// Stopped, or not reading its socket: it forks nothing more.
		z.cmd.Process.Kill()
		<-exited
	}
	return err
}

// spawnZygote starts a QEMU through o.Zygote: the counterpart of cmd.Start for Spawn.
// It returns the process, our child, to be waited on.
func spawnZygote(o SpawnOptions, logf *os.File) (*os.Process, error) {
	dir := o.Dir
	if dir == "" {
		var err error
		if dir, err = os.Getwd(); err != nil {
			return nil, &StartError{Err: err}
		}
	}
	pid, err := o.Zygote.fork(o.Args, dir, logf)
	if err != nil {
		return nil, &StartError{Err: err}
	}
	// Our child since the zygote answered, and a zombie until reaped here: the pid
	// cannot name another process.
	proc, err := os.FindProcess(pid)
	if err != nil {
		return nil, &StartError{Err: err}
	}
	return proc, nil
}
