package engine

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path"
	"strings"
	"time"

	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/tarstream"
	"github.com/forkvm/forkvm/vsockd"
)

// AgentTarget is what is needed to reach a VM's agent without an engine (so that a
// long interactive exec does not hold the state directory lock).
type AgentTarget struct {
	Name string `json:"name"`
	// Socket is the agent's virtio-serial chardev socket (used when CID is 0).
	Socket string `json:"socket"`
	// CID is the guest's AF_VSOCK context id; non-zero means dial vsock.
	CID   uint32 `json:"cid,omitempty"`
	Token string `json:"token"`
}

// hello is the handshake that makes a VM ready: the VM's own token (a fork answers only
// to its own, so a fork cannot be mistaken for its parent or a sibling), fresh host
// entropy for the guest CRNG (a fork starts with its parent's RNG state), the host clock
// (a fork's clock is its checkpoint's) and the hostname.
func (t AgentTarget) hello() (vsockd.Hello, error) {
	tok, err := parseToken(t.Token)
	if err != nil {
		return vsockd.Hello{}, err
	}
	ent := make([]byte, 32)
	_, _ = rand.Read(ent)
	return vsockd.Hello{Token: tok, Entropy: ent, Time: time.Now(), Hostname: t.Name}, nil
}

// DialAgent connects to an agent and performs the handshake (see AgentTarget.hello). It
// fails with ErrAgentTimeout wrapped when ctx ends first.
func DialAgent(ctx context.Context, t AgentTarget) (*vsockd.Client, error) {
	if _, err := parseToken(t.Token); err != nil {
		return nil, err
	}
	conn, err := dialTarget(ctx, t)
	if err != nil {
		return nil, agentErr(ctx, t.Name, err)
	}
	c := vsockd.NewClient(conn, nil)
	if err := sayHello(ctx, c, t); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// helloLate is the hello round trip past which sayHello says hello again. The guest sets
// its clock to the time a hello was sent, so a hello it read late (a fork restored on a
// loaded host, whose agent ran seconds after the engine wrote the hello) leaves its clock
// behind by that delay; the running agent answers the next hello at once, and the clock
// is then off by at most that round trip.
const helloLate = 500 * time.Millisecond

// helloTries bounds the hellos of one handshake.
const helloTries = 4

// helloResend is how long a hello waits for its answer before it is said again. A guest
// agent can miss the wake-up for a message on its virtio-serial port (the guest driver
// races a concurrent poll of the port against the queue's interrupt, and the interrupt
// is dropped: lmb/vimto#29), and then sleeps with the hello unread while the engine
// waits for its answer until the boot times out. The next message's interrupt wakes it:
// it reads both and answers each; the client takes the last answer (an earlier one's
// stream is gone). A slow guest that reads them all late just answers them all.
const helloResend = 5 * time.Second

// sayHello runs the handshake on an open agent connection, again while the guest answers
// late (helloLate) and again while it does not answer (helloResend).
func sayHello(ctx context.Context, c *vsockd.Client, t AgentTarget) error {
	return sayHelloEvery(ctx, c, t, helloResend)
}

// sayHelloEvery is sayHello with the resend interval resend.
func sayHelloEvery(ctx context.Context, c *vsockd.Client, t AgentTarget, resend time.Duration) error {
	for try := 1; ; {
		h, err := t.hello()
		if err != nil {
			return err
		}
		tctx, cancel := context.WithTimeout(ctx, resend)
		_, err = c.Hello(tctx, h)
		unanswered := err != nil && ctx.Err() == nil && tctx.Err() != nil
		cancel()
		if unanswered {
			continue
		}
		if err != nil {
			return agentErr(ctx, t.Name, err)
		}
		if time.Since(h.Time) <= helloLate || try == helloTries {
			return nil
		}
		try++
	}
}

// agentErr wraps an agent failure, as ErrAgentTimeout when ctx ended.
func agentErr(ctx context.Context, name string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w: %s: %w", ErrAgentTimeout, name, err)
	}
	return fmt.Errorf("engine: agent %s: %w", name, err)
}

// dialTarget connects to an agent over vsock (retrying while the guest's listener is not
// up yet) or its virtio-serial socket.
func dialTarget(ctx context.Context, t AgentTarget) (net.Conn, error) {
	if t.CID == 0 {
		return vsockd.DialUnix(ctx, t.Socket)
	}
	for {
		conn, err := vsockd.DialVsock(ctx, t.CID, vsockd.DefaultVsockPort)
		if err == nil {
			return conn, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// clientDone reports whether an agent connection has ended.
func clientDone(c *vsockd.Client) bool {
	select {
	case <-c.Done():
		return true
	default:
		return false
	}
}

// Files in and out of a VM, and its console.
//
// The engine never opens a host path on a guest's behalf: a copy moves a tar stream
// between the caller's reader or writer and the guest agent, which extracts (or writes)
// it in the guest. CopyInPath and CopyOutPath open the host path their caller names,
// with package tarstream, as the forkvm CLI does. Whoever extracts a stream the guest
// sent on the host must not trust it: tarstream.ExtractTar confines every entry to its
// destination (the forkvm CLI uses it with Top set to the source's base name).

// logPoll is how often Logs looks for new console output while following.
const logPoll = 200 * time.Millisecond

// CopyIn extracts the tar stream r into the guest directory guestDir, which must exist
// (else the error wraps ErrNotDirectory). The agent extracts while r is read, in Go, and
// writes nothing outside guestDir whatever the archive holds (ErrUnsafeEntry names an
// entry that tried; see tarstream.ExtractTar): modes and modification times are kept,
// owners are not (files belong to root), set-ID bits are dropped. An archive made with
// tarstream.WriteTar copies a file, a directory tree or a symlink. What was extracted
// before an error stays.
func (vm *VM) CopyIn(ctx context.Context, guestDir string, r io.Reader) error {
	return vm.withAgent(ctx, "copy", func(ctx context.Context, c *vsockd.Client) error { return c.CopyIn(ctx, guestDir, r) })
}

// CopyOut writes a tar stream of the guest path guestPath to w as the agent produces
// it: a file, a directory and everything below it, or a symlink as a symlink, in entries
// named after guestPath's base name (see tarstream.WriteTar). A missing guestPath wraps
// ErrSourceMissing. The stream comes from the guest: extract it with tarstream.ExtractTar
// (ExtractOptions.Top set to the base name), never with a tool that trusts it.
func (vm *VM) CopyOut(ctx context.Context, guestPath string, w io.Writer) error {
	return vm.withAgent(ctx, "copy", func(ctx context.Context, c *vsockd.Client) error { return c.CopyOut(ctx, guestPath, w) })
}

// CopyInPath copies the host path hostPath (a file, a directory tree or a symlink, as
// tarstream.WriteTar archives it) into the existing guest directory guestDir under its
// base name: CopyIn of a tar stream of hostPath, without the caller's pipe. A missing
// hostPath wraps ErrSourceMissing, a missing guestDir ErrNotDirectory.
func (vm *VM) CopyInPath(ctx context.Context, hostPath, guestDir string) error {
	return tarstream.CopyInPath(ctx, hostPath, func(r io.Reader) error { return vm.CopyIn(ctx, guestDir, r) })
}

// CopyOutPath copies the guest path guestPath into the existing host directory hostDir
// under its base name. The guest's stream is extracted with tarstream.ExtractTar: every
// entry must be below that name, and nothing is written outside hostDir. A missing
// guestPath wraps ErrSourceMissing. What was extracted before an error stays.
func (vm *VM) CopyOutPath(ctx context.Context, guestPath, hostDir string) error {
	name := path.Base(path.Clean(guestPath))
	if name == "/" || name == "." || name == ".." {
		return fmt.Errorf("%w: copy out of %q: name a file or directory below /", ErrInvalidSpec, guestPath)
	}
	pr, pw := io.Pipe()
	errc := make(chan error, 1)
	go func() {
		err := vm.CopyOut(ctx, guestPath, pw)
		pw.CloseWithError(err)
		errc <- err
	}()
	xerr := tarstream.ExtractTar(ctx, pr, hostDir, &tarstream.ExtractOptions{Top: name})
	// Unblock CopyOut if the extraction stopped first (it then aborts the stream).
	pr.CloseWithError(errors.Join(xerr, io.ErrClosedPipe))
	if cerr := <-errc; cerr != nil && (xerr == nil || !errors.Is(cerr, io.ErrClosedPipe)) {
		return cerr // the guest's own error says best what went wrong
	}
	return xerr
}

// Stat returns the attributes of the guest path guestPath (symlinks followed); a missing
// path matches fs.ErrNotExist.
func (vm *VM) Stat(ctx context.Context, guestPath string) (fs.FileInfo, error) {
	var fi fs.FileInfo
	err := vm.withAgent(ctx, "stat", func(ctx context.Context, c *vsockd.Client) error {
		var err error
		fi, err = c.Stat(ctx, guestPath)
		return err
	})
	return fi, err
}

// serialLog is the file QEMU writes the guest console to.
func (vm *VM) serialLog() string {
	p := vm.snapshot().Launch.SerialLog
	if p == "" {
		p = vm.path(serialLogFile)
	}
	return p
}

// Logs writes the guest's serial console to w: the kernel's messages and the agent's,
// as the engine (or its console keeper) records them in StateDir/vms/NAME (the last MiB at most:
// older output is dropped). A fork's console starts with its checkpoint's, up to the
// checkpoint, and a line saying where the fork begins. Without follow it returns at
// the end of what was written so far. With follow it then keeps copying what the guest
// prints until the VM's QEMU exits (nil, guestEndWait later, so that the guest's last
// output is in; a handoff checkpoint replaces the process, and ends the following too)
// or ctx ends (ctx's error). Logs reads files only: it works on
// a VM whose QEMU is gone.
func (vm *VM) Logs(ctx context.Context, follow bool, w io.Writer) error {
	if follow {
		// Nothing to follow: a parked VM's console has no QEMU behind it.
		if err := vm.errIfParked(); err != nil {
			return err
		}
	}
	p := vm.serialLog()
	fail := func(err error) error { return fmt.Errorf("engine: logs %s: %w", vm.Name(), err) }
	// The rotated half first (it may be missing).
	if old, err := os.Open(p + console.RotatedSuffix); err == nil {
		_, err := io.Copy(w, old)
		old.Close()
		if err != nil {
			return fail(err)
		}
	}
	f, err := os.Open(p)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if _, serr := os.Stat(p + console.RotatedSuffix); serr == nil && !follow {
				return nil
			}
			return fmt.Errorf("%w: %s has no console log", ErrNotFound, vm.Name())
		}
		return fail(err)
	}
	defer func() { f.Close() }()
	done := vm.Done()
	buf := make([]byte, 32<<10)
	var off int64
	// drain copies up to the current end of the file.
	drain := func() error {
		for {
			if err := ctx.Err(); err != nil {
				return err
			}
			n, err := f.Read(buf)
			if n > 0 {
				off += int64(n)
				if _, werr := w.Write(buf[:n]); werr != nil {
					return werr
				}
			}
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return fail(err)
			}
		}
	}
	if err := drain(); err != nil || !follow {
		return err
	}
	tick := time.NewTicker(logPoll)
	defer tick.Stop()
	var ending <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-done:
			// QEMU exited, but what the guest printed last (a panic) may still be on
			// its way into the log: whoever serves the console copies it from the
			// socket after the exit. Follow on for guestEndWait, as guestEnd waits.
			done, ending = nil, time.After(guestEndWait)
			continue
		case <-ending:
			return drain()
		case <-tick.C:
		}
		if err := drain(); err != nil {
			return err
		}
		// The log was rotated: what f holds is complete (drained above); go on
		// with the new file. A shorter file is a truncated one: start over.
		cur, err := os.Stat(p)
		if err != nil {
			continue
		}
		if st, err := f.Stat(); err == nil && !os.SameFile(st, cur) {
			nf, err := os.Open(p)
			if err != nil {
				continue
			}
			if err := drain(); err != nil { // what was written before the rotation
				nf.Close()
				return err
			}
			f.Close()
			f, off = nf, 0
		} else if err == nil && st.Size() < off {
			if _, err := f.Seek(0, io.SeekStart); err != nil {
				return fail(err)
			}
			off = 0
		}
		if err := drain(); err != nil {
			return err
		}
	}
}

// ExitError is returned by VM.Output when the command ran and exited with a non-zero
// code (or was killed: ExecRequest's conventions, 128+signal).
type ExitError struct {
	Argv   []string
	Code   int
	Stderr []byte // the command's standard error
}

// Error implements error.
func (e *ExitError) Error() string {
	msg := fmt.Sprintf("engine: %s exited %d", strings.Join(e.Argv, " "), e.Code)
	if s := strings.TrimSpace(string(e.Stderr)); s != "" {
		msg += ": " + s
	}
	return msg
}

// Output runs argv in the VM (as Exec does, with an empty stdin) and returns its
// standard output, so that a caller need not wire a bytes.Buffer as Stdout. A command
// that exits non-zero returns its output so far and an *ExitError carrying its code
// and standard error; a command that could not run returns Exec's error.
func (vm *VM) Output(ctx context.Context, argv ...string) ([]byte, error) {
	if len(argv) == 0 {
		return nil, fmt.Errorf("%w: Output needs a command", ErrInvalidSpec)
	}
	var stdout, stderr bytes.Buffer
	code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: argv, Stdout: &stdout, Stderr: &stderr})
	if err != nil {
		return stdout.Bytes(), err
	}
	if code != 0 {
		return stdout.Bytes(), &ExitError{Argv: argv, Code: code, Stderr: stderr.Bytes()}
	}
	return stdout.Bytes(), nil
}
