//go:build unix

package vsockd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"
)

const sigKill = int(syscall.SIGKILL)

// openNonblock opens a file without waiting: a FIFO with no writer yet, a terminal
// without carrier. Reads of such a file then wait in the poller, where Close ends them.
const openNonblock = syscall.O_NONBLOCK

// defaultPath is the PATH given to processes that do not set one.
const defaultPath = "/bin:/sbin:/usr/bin:/usr/sbin"

// waitResult is the decoded exit status of a process.
type waitResult struct {
	code   int // exit status or 128+signal
	signal int
}

func decodeStatus(ws syscall.WaitStatus) waitResult {
	if ws.Signaled() {
		return waitResult{code: 128 + int(ws.Signal()), signal: int(ws.Signal())}
	}
	return waitResult{code: ws.ExitStatus()}
}

// reaper collects exit statuses of child processes.
//
// As PID 1 (all == true) it must also reap orphans re-parented to it, so a
// single goroutine handles SIGCHLD with a wait4(-1, WNOHANG) loop and
// dispatches each status to the waiter registered for that pid; statuses of
// unknown pids (orphans) are dropped. start holds mu across fork and
// registration, and the loop looks pids up under mu after wait4 returns, so
// a child that exits immediately can never be reaped before it is
// registered.
//
// Otherwise (tests, development) wait4(-1) would steal children of the rest
// of the program, so each process gets a goroutine blocked in wait4(pid).
type reaper struct {
	all     bool
	mu      sync.Mutex
	waiters map[int]chan waitResult
}

var (
	theReaper     *reaper
	theReaperOnce sync.Once
)

func getReaper() *reaper {
	theReaperOnce.Do(func() {
		theReaper = &reaper{all: os.Getpid() == 1, waiters: map[int]chan waitResult{}}
		if theReaper.all {
			sigs := make(chan os.Signal, 16)
			signal.Notify(sigs, syscall.SIGCHLD)
			go theReaper.loop(sigs)
		}
	})
	return theReaper
}

func (r *reaper) loop(sigs chan os.Signal) {
	// SIGCHLD delivery may coalesce, but one pending notification suffices
	// because reapAll drains every zombie. There is no frequent wake-up: an
	// idle agent must let its guest sleep (a wake-up costs host CPU under
	// TCG); the rare recheck is only a safety net.
	tick := time.NewTicker(time.Minute)
	defer tick.Stop()
	for {
		select {
		case <-sigs:
		case <-tick.C:
		}
		r.reapAll()
	}
}

func (r *reaper) reapAll() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil || pid <= 0 {
			return
		}
		r.mu.Lock()
		ch := r.waiters[pid]
		delete(r.waiters, pid)
		r.mu.Unlock()
		if ch != nil {
			ch <- decodeStatus(ws)
		}
	}
}

// start runs fork and arranges for the child's status to be delivered on
// the returned channel (buffered, so nobody has to receive it).
func (r *reaper) start(fork func() (int, error)) (int, <-chan waitResult, error) {
	ch := make(chan waitResult, 1)
	r.mu.Lock()
	pid, err := fork()
	if err != nil {
		r.mu.Unlock()
		return 0, nil, err
	}
	if r.all {
		r.waiters[pid] = ch
		r.mu.Unlock()
		return pid, ch, nil
	}
	r.mu.Unlock()
	go func() {
		for {
			var ws syscall.WaitStatus
			_, err := syscall.Wait4(pid, &ws, 0, nil)
			if err == syscall.EINTR {
				continue
			}
			if err != nil {
				ch <- waitResult{code: -1}
			} else {
				ch <- decodeStatus(ws)
			}
			return
		}
	}()
	return pid, ch, nil
}

// proc is a running guest process.
type proc struct {
	pid    int // also the process group id
	status <-chan waitResult
	exited atomic.Bool

	tty    *os.File // pty master (TTY mode)
	stdin  *os.File // pipe write end (pipe mode)
	stdout *os.File
	stderr *os.File

	stdinOnce sync.Once
	closeOnce sync.Once

	// What went to the terminal (TTY mode), for endStdin: whether anything was written,
	// the last byte, and whether the input ended. feedStdin's goroutine alone uses them.
	ttyWrote, ttyEnded bool
	ttyLast            byte

	// The cgroup the process started in (Server.ExecCgroup), given back once it ended.
	cgroups    *execCgroups
	cgroup     *os.File
	cgroupPath string // "" where it has none of its own
	cgroupOnce sync.Once

	// cgMu is held while the cgroup is killed, so that it is not given back (and
	// reused by the next command) meanwhile; cgReleased says it was given back.
	cgMu       sync.Mutex
	cgReleased bool
	cgKillOnce sync.Once
	cgKilled   atomic.Bool   // its cgroup was killed: see waitKilled
	cgKillDone chan struct{} // closed once that kill is done; set before cgKilled
}

// releaseCgroup gives the process's cgroup back to its Server once the process has
// ended (or never started), once a kill of it under way is done.
func (p *proc) releaseCgroup() {
	if p.cgroups != nil {
		p.cgroupOnce.Do(func() {
			p.cgMu.Lock()
			p.cgReleased = true
			p.cgMu.Unlock()
			p.cgroups.release(p.cgroup, p.cgroupPath)
		})
	}
}

type output struct {
	t FrameType
	f *os.File
}

func (p *proc) outputs() []output {
	if p.tty != nil {
		return []output{{TypeStdout, p.tty}}
	}
	return []output{{TypeStdout, p.stdout}, {TypeStderr, p.stderr}}
}

// writeStdin writes the host's input b to the command: its stdin pipe or its terminal.
// Input after the terminal's input ended (endStdin) fails, as it does on a closed pipe.
func (p *proc) writeStdin(b []byte) (int, error) {
	if p.tty == nil {
		return p.stdin.Write(b)
	}
	if p.ttyEnded {
		return 0, fmt.Errorf("write %s: input ended: %w", p.tty.Name(), os.ErrClosed)
	}
	n, err := p.tty.Write(b)
	if n > 0 {
		p.ttyWrote, p.ttyLast = true, b[n-1]
	}
	return n, err
}

// endStdin ends the command's input when the host's stdin ended (StdinClose). A stdin
// pipe is closed. A terminal cannot be: closing its master hangs up the command's
// session and loses the output still to come, so the end is typed as a user types it:
// the terminal's end-of-file character (VEOF, ^D). In canonical mode a read of an
// empty line then returns 0, which programs take for the end of their input (cat
// exits); after a partial line a VEOF only hands the line over, so a second one
// follows. A terminal in non-canonical (raw) mode has no end of file: the one VEOF
// reaches the program as the key that ends input in programs that read keys (shells).
func (p *proc) endStdin() error {
	if p.tty == nil {
		p.closeStdin()
		return nil
	}
	var err error
	p.stdinOnce.Do(func() {
		var eof []byte
		if eof, err = ttyEOF(p.tty, p.ttyWrote, p.ttyLast); err == nil && len(eof) > 0 {
			_, err = p.tty.Write(eof)
		}
		p.ttyEnded = true
	})
	return err
}

// ttyEOF is what ends the input of the terminal whose master is f (see endStdin), given
// the last byte written to it (wrote false: none): VEOF, twice after a partial line in
// canonical mode; nothing where VEOF is disabled. A line is partial unless its last
// byte ends a line: newline, carriage return where ICRNL makes it one, VEOL, VEOL2, or
// VEOF itself.
func ttyEOF(f *os.File, wrote bool, last byte) ([]byte, error) {
	sc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	var t *unix.Termios
	var terr error
	if err := sc.Control(func(fd uintptr) { t, terr = unix.IoctlGetTermios(int(fd), ioctlGetTermios) }); err != nil {
		return nil, err
	}
	if terr != nil {
		return nil, fmt.Errorf("terminal attributes of %s: %w", f.Name(), terr)
	}
	veof := t.Cc[unix.VEOF]
	if veof == vdisable {
		return nil, nil
	}
	if t.Lflag&unix.ICANON == 0 || !wrote {
		return []byte{veof}, nil
	}
	switch {
	case last == '\n', last == veof,
		last == '\r' && t.Iflag&unix.ICRNL != 0 && t.Iflag&unix.IGNCR == 0,
		last == t.Cc[unix.VEOL] && last != vdisable,
		last == t.Cc[unix.VEOL2] && last != vdisable:
		return []byte{veof}, nil
	}
	return []byte{veof, veof}, nil
}

// closeStdin closes the stdin pipe (pipe mode; see endStdin for a terminal).
func (p *proc) closeStdin() {
	if p.stdin != nil {
		p.stdinOnce.Do(func() { p.stdin.Close() })
	}
}

// markExited records that the process was reaped and makes output reads
// give up after idle (the server's drainIdle) of inactivity.
func (p *proc) markExited(idle time.Duration) {
	p.exited.Store(true)
	for _, o := range p.outputs() {
		o.f.SetReadDeadline(time.Now().Add(idle))
	}
}

// readReady reads what f holds now without waiting, for a read whose deadline
// passed: n > 0 for output already there, io.EOF at its end, and
// os.ErrDeadlineExceeded when f is empty (idle). The deadline is cleared; the
// caller sets the next.
func readReady(f *os.File, buf []byte) (int, error) {
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		return 0, err
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var rerr error
	if err := rc.Read(func(fd uintptr) bool {
		n, rerr = unix.Read(int(fd), buf)
		return true // one attempt: never wait
	}); err != nil {
		return 0, err
	}
	switch {
	case errors.Is(rerr, unix.EAGAIN):
		return 0, os.ErrDeadlineExceeded
	case rerr != nil:
		return 0, rerr
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// outputLeft reports, without reading, what the output f (a pipe's read end, or a pty
// master) holds for a process that exited: queued, the bytes in it now (FIONREAD; on a
// pty master, those its terminal has processed), and closed, whether no process holds
// its other end any more (POLLHUP), so that nothing can be added to what it holds.
func outputLeft(f *os.File) (queued int, closed bool) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, false
	}
	rc.Control(func(fd uintptr) {
		if n, err := unix.IoctlGetInt(int(fd), fionread); err == nil {
			queued = n
		}
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if n, err := unix.Poll(pfd, 0); err == nil && n > 0 && pfd[0].Revents&unix.POLLHUP != 0 {
			closed = true
		}
	})
	return queued, closed
}

// signal sends the host's signal sig to the command: SIGKILL kills it and all it
// started (kill); any other signal goes to its process group alone, as a terminal's
// does, for the command to pass on or not.
func (p *proc) signal(sig int) {
	if sig == sigKill {
		p.kill()
		return
	}
	p.signalGroup(sig)
}

// signalGroup sends sig to the process group unless the process has already been reaped
// (its pid could have been reused).
func (p *proc) signalGroup(sig int) {
	if p.exited.Load() {
		return
	}
	if err := unix.Kill(-p.pid, syscall.Signal(sig)); err != nil {
		unix.Kill(p.pid, syscall.Signal(sig))
	}
}

// cgroupKillMax bounds the wait for a killed command's cgroup to empty (killFrozen's
// work, waitKilled): a task that cannot die (stuck in the kernel) must not hold up the
// exec's end past the host's TimeoutGrace.
const cgroupKillMax = 2 * time.Second

// kill ends the command with SIGKILL (the host's kill, a timeout, a stream's reset)
// unless it has already been reaped. Its process group is killed, as before; where the
// command has a cgroup of its own, everything in it is too: a child that left the
// process group (setsid, a daemonising shell) escapes the group but not the cgroup, and
// otherwise ran on after the exec ended, holding its output pipes. A command that ended
// by itself is never killed this way: the daemons it left are meant to stay.
//
// kill runs on the connection's reader, so it never waits: cgroup.kill is one write;
// on kernels without it, the freeze-and-kill goes on on a goroutine holding cgMu.
func (p *proc) kill() {
	if p.exited.Load() {
		return
	}
	if p.cgroupPath == "" {
		p.signalGroup(sigKill)
		return // in the shared parent cgroup, or none: its other tasks are not ours
	}
	p.cgKillOnce.Do(func() {
		p.cgMu.Lock()
		if p.cgReleased {
			p.cgMu.Unlock()
			return
		}
		// Marked before the process group's SIGKILL: the exit it brings must find the
		// mark, so that the Exit waits for this kill (waitKilled, on cgKillDone).
		// Marked after, an exit reaped in between sent the Exit with the cgroup still
		// frozen or its escaped tasks alive.
		done := make(chan struct{})
		p.cgKillDone = done
		p.cgKilled.Store(true)
		p.signalGroup(sigKill)
		if h := p.cgroups.afterGroupKill; h != nil {
			h(p)
		}
		if p.cgroups.killNow(p.cgroupPath) {
			close(done)
			p.cgMu.Unlock()
			return
		}
		go func() {
			defer p.cgMu.Unlock()
			defer close(done)
			ctx, cancel := context.WithTimeout(context.Background(), cgroupKillMax)
			defer cancel()
			p.cgroups.killFrozen(ctx, p.cgroupPath)
		}()
	})
	p.signalGroup(sigKill) // a kill after the first, or of a cgroup given back
}

// waitKilled waits, once the command's cgroup was killed, until nothing is left in it
// and the kill is done (the cgroup thawed), or ctx ends, or cgroupKillMax passed: so
// that the exec's end means its tasks are gone. It returns at once for a command not
// killed that way.
func (p *proc) waitKilled(ctx context.Context) {
	if !p.cgKilled.Load() {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, cgroupKillMax)
	defer cancel()
	// The kill first (cgroup.kill written, or killFrozen's goroutine, itself bounded
	// by cgroupKillMax, done), then the tasks' ends.
	select {
	case <-p.cgKillDone:
	case <-ctx.Done():
	}
	waitCgroupEmpty(ctx, p.cgroupPath)
}

func (p *proc) resize(rows, cols uint16) error {
	if p.tty == nil {
		return errors.New("not a tty")
	}
	return setWinsize(p.tty, rows, cols)
}

func (p *proc) closeFiles() {
	p.closeOnce.Do(func() {
		p.closeStdin()
		for _, f := range []*os.File{p.tty, p.stdout, p.stderr} {
			if f != nil {
				f.Close()
			}
		}
	})
}

// setWinsize sets the terminal size without switching f to blocking mode
// (pty.Setsize uses f.Fd(), which would defeat deadlines and Close).
func setWinsize(f *os.File, rows, cols uint16) error {
	sc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ierr error
	err = sc.Control(func(fd uintptr) {
		ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols})
	})
	if err != nil {
		return err
	}
	return ierr
}

// buildEnv merges the request environment over the defaults (HOME, USER and LOGNAME
// from user when it is set).
func buildEnv(req *execStartWire, user *execUser) []string {
	env := []string{"PATH=" + defaultPath, "HOME=/root"}
	if user != nil {
		env[1] = "HOME=" + user.home
		if user.name != "" {
			env = append(env, "USER="+user.name, "LOGNAME="+user.name)
		}
	}
	if req.TTY {
		term := req.Term
		if term == "" {
			term = "xterm"
		}
		env = append(env, "TERM="+term)
	}
	env = append(env, req.Env...)
	// Deduplicate: the last assignment of a key wins, order of first use kept.
	idx := map[string]int{}
	out := env[:0:0]
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if i, ok := idx[k]; ok {
			out[i] = kv
			continue
		}
		idx[k] = len(out)
		out = append(out, kv)
	}
	return out
}

func envValue(env []string, key string) string {
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			return v
		}
	}
	return ""
}

// execError is a failure to start a command, classified for the host by an
// Error frame code (CodeNotFound, CodeNotExecutable, CodeWorkdir, CodeExec).
type execError struct {
	code string
	msg  string
}

func (e *execError) Error() string { return e.msg }

// classifyExecErr maps an execve/fork errno to an error code, like a shell
// does for its 127/126 exit codes.
func classifyExecErr(err error) string {
	switch {
	case errors.Is(err, syscall.ENOENT):
		return CodeNotFound
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.ENOEXEC), errors.Is(err, syscall.EISDIR),
		errors.Is(err, syscall.EPERM), errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.ETXTBSY),
		errors.Is(err, syscall.ELOOP):
		return CodeNotExecutable
	}
	return CodeExec
}

// checkDir reports a working directory that does not exist or is not a
// directory, naming it (ForkExec cannot tell a failed chdir from a failed
// execve: both come back as the child's errno).
func checkDir(dir string) error {
	if dir == "" {
		return nil
	}
	fi, err := os.Stat(dir)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return &execError{CodeWorkdir, fmt.Sprintf("%s: %v", dir, err)}
	}
	if !fi.IsDir() {
		return &execError{CodeWorkdir, fmt.Sprintf("%s: not a directory", dir)}
	}
	return nil
}

// checkDirFor reports a working directory that user cannot enter (a directory on its
// path it may not search), naming the directory and the user: the agent checks as
// root, so checkDir alone passes, and the child's failed chdir would come back from
// ForkExec as its errno, indistinguishable from a failed execve ("pwd: permission
// denied" for a command that is fine). Mode bits only (the guest's root images carry
// no ACLs the agent would honour differently). A root user enters anything.
func checkDirFor(dir string, user *execUser, spec string) error {
	if dir == "" || user == nil || user.uid == 0 {
		return nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return &execError{CodeWorkdir, fmt.Sprintf("%s: %v", dir, err)}
	}
	if real, err := filepath.EvalSymlinks(abs); err == nil {
		abs = real
	}
	p := "/"
	for _, part := range append([]string{""}, strings.Split(strings.TrimPrefix(abs, "/"), "/")...) {
		p = filepath.Join(p, part)
		fi, err := os.Stat(p)
		if err != nil {
			return &execError{CodeWorkdir, fmt.Sprintf("%s: %v", dir, err)}
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return nil
		}
		if !canSearch(fi.Mode().Perm(), st.Uid, st.Gid, user) {
			where := ""
			if p != abs {
				where = fmt.Sprintf(" (%s is mode %#o, owner %d:%d)", p, fi.Mode().Perm(), st.Uid, st.Gid)
			}
			return &execError{CodeWorkdir, fmt.Sprintf("%s: permission denied for user %s%s", dir, spec, where)}
		}
	}
	return nil
}

// canSearch reports whether user may search (x) a directory of mode perm owned by
// uid:gid, by the owner, group, other classes as the kernel picks them.
func canSearch(perm fs.FileMode, uid, gid uint32, user *execUser) bool {
	switch {
	case uid == user.uid:
		return perm&0o100 != 0
	case gid == user.gid || slices.Contains(user.groups, gid):
		return perm&0o010 != 0
	}
	return perm&0o001 != 0
}

// lookPath resolves file using the PATH of the child environment (not the
// agent's own), relative to dir for relative PATH entries. A file found in
// PATH but not executable is reported as CodeNotExecutable (as sh does),
// nothing at all as CodeNotFound.
func lookPath(file string, env []string, dir string) (string, error) {
	if strings.Contains(file, "/") {
		return file, nil
	}
	denied := ""
	for _, d := range filepath.SplitList(envValue(env, "PATH")) {
		if d == "" {
			d = "."
		}
		p := filepath.Join(d, file)
		check := p
		if !filepath.IsAbs(check) && dir != "" {
			check = filepath.Join(dir, check)
		}
		fi, err := os.Stat(check)
		if err != nil {
			continue
		}
		if fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
		if denied == "" {
			denied = p
		}
	}
	if denied != "" {
		return "", &execError{CodeNotExecutable, fmt.Sprintf("%s: permission denied", denied)}
	}
	return "", &execError{CodeNotFound, file}
}

// startProcess starts req without os/exec, in its own process group (pipe
// mode) or session with a controlling pty (TTY mode).
func startProcess(req *execStartWire, srv *Server) (*proc, error) {
	var user *execUser
	var cred *syscall.Credential
	if req.User != "" {
		u, err := lookupUser(req.User, passwdFile, groupFile)
		if err != nil {
			return nil, err
		}
		if euid := os.Geteuid(); euid != 0 && uint32(euid) != u.uid {
			return nil, &execError{CodeExec, fmt.Sprintf("running as %q needs a root agent", req.User)}
		}
		user = u
		cred = &syscall.Credential{Uid: u.uid, Gid: u.gid, Groups: u.groups}
	}
	env := buildEnv(req, user)
	if err := checkDir(req.Dir); err != nil {
		return nil, err
	}
	if err := checkDirFor(req.Dir, user, req.User); err != nil {
		return nil, err
	}
	path, err := lookPath(req.Argv[0], env, req.Dir)
	if err != nil {
		return nil, err
	}
	p := &proc{}
	var childFiles []*os.File
	closeChild := func() {
		for _, f := range childFiles {
			f.Close()
		}
	}
	attr := &syscall.ProcAttr{Dir: req.Dir, Env: env}
	if req.TTY {
		master, slave, err := pty.Open()
		if err != nil {
			return nil, fmt.Errorf("open pty: %w", err)
		}
		// pty.Open leaves the master in blocking mode; re-open it as a
		// non-blocking, poller-managed file so deadlines and Close work.
		fd, err := unix.Dup(int(master.Fd()))
		master.Close()
		if err != nil {
			slave.Close()
			return nil, err
		}
		unix.CloseOnExec(fd)
		if err := unix.SetNonblock(fd, true); err != nil {
			unix.Close(fd)
			slave.Close()
			return nil, err
		}
		p.tty = os.NewFile(uintptr(fd), "/dev/ptmx")
		if req.Rows > 0 && req.Cols > 0 {
			setWinsize(p.tty, req.Rows, req.Cols)
		}
		childFiles = []*os.File{slave}
		if user != nil {
			// The terminal belongs to its user, as login(1) makes it.
			slave.Chown(int(user.uid), -1)
		}
		attr.Files = []uintptr{slave.Fd(), slave.Fd(), slave.Fd()}
		attr.Sys = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0, Credential: cred}
	} else {
		inR, inW, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		outR, outW, err := os.Pipe()
		if err != nil {
			inR.Close()
			inW.Close()
			return nil, err
		}
		errR, errW, err := os.Pipe()
		if err != nil {
			inR.Close()
			inW.Close()
			outR.Close()
			outW.Close()
			return nil, err
		}
		p.stdin, p.stdout, p.stderr = inW, outR, errR
		childFiles = []*os.File{inR, outW, errW}
		attr.Files = []uintptr{inR.Fd(), outW.Fd(), errW.Fd()}
		attr.Sys = &syscall.SysProcAttr{Setpgid: true, Credential: cred}
	}
	if srv != nil {
		p.cgroups = &srv.cgroups
		if p.cgroup, p.cgroupPath = p.cgroups.take(srv.ExecCgroup, srv.ExecPidsMax); p.cgroup != nil {
			inCgroup(attr.Sys, p.cgroup)
		}
	}
	pid, status, err := getReaper().start(func() (int, error) {
		return syscall.ForkExec(path, req.Argv, attr)
	})
	closeChild()
	if err != nil {
		p.closeFiles()
		p.releaseCgroup()
		if derr := checkDir(req.Dir); derr != nil { // removed while we started
			return nil, derr
		}
		if derr := checkDirFor(req.Dir, user, req.User); derr != nil { // or its mode changed
			return nil, derr
		}
		return nil, &execError{classifyExecErr(err), fmt.Sprintf("%s: %v", req.Argv[0], err)}
	}
	p.pid, p.status = pid, status
	return p, nil
}
