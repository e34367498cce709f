// Package console is the guest console, bounded: the engine's console hub, the
// keeper that serves consoles after the engine, and their rotating log.
//
// A guest prints as fast as it likes on its serial port, and QEMU's file chardev
// appends without limit: a hostile guest fills the host's disk. So QEMU never writes
// the log itself. Its serial port is a unix socket client (with reconnect-ms) of
// RUNDIR/NAME/console.sock; whoever serves that socket appends what it reads to
// StateDir/vms/NAME/serial.log and rotates it to serial.log.1 when it reaches
// LogHalf, so the console takes at most 2 × LogHalf on disk: the last output, older
// output dropped. A guest that prints faster than the log is written is slowed down
// (the socket fills), never the host.
//
// Who serves a console:
//
//   - While the engine that started the VM runs, its Hub does, in the engine's own
//     process: a listener made before QEMU starts and a goroutine that accepts QEMU's
//     connection and copies it. Starting a VM starts no process for its console.
//   - VMs outlive the engine (the CLI exits right after a fork; a daemon stops). When
//     the engine closes, the Hub hands every console still open (its listener, QEMU's
//     connected socket and the log's path) to one keeper process: this binary,
//     re-executed (see init), serving them all. Connected sockets are passed, not
//     re-made, so no output is lost at the hand-off. The keeper exits when every
//     connection it serves is closed (their QEMUs exited), or when a console it got
//     unconnected saw no QEMU within keeperAcceptWait.
//   - If the engine dies without closing (kill -9), its consoles' sockets die with
//     it. QEMU then reconnects every reconnectMs; the next engine that opens the
//     state directory serves the consoles of running VMs that no live keeper serves
//     (Hub.Recover: it listens on their sockets again). Output printed while nobody
//     listens is dropped by QEMU (its serial port does not wait for a disconnected
//     chardev): the guest is never blocked, its output is lost until the console is
//     served again. The same holds while a keeper killed by hand is not yet replaced.
//
// console.pid in a VM's run directory records which process serves its console (PID
// and start time: the engine while its Hub does, else the keeper), so that Recover and
// Stop can find it. Stop guarantees nothing writes a removed VM's log once it returns:
// it ends the Hub's copy, or waits for the keeper serving it to let go of the log (its
// QEMU is dead, so the keeper sees the connection close) without ending a keeper that
// serves other VMs.
//
// The surface: a Hub per engine (Start before QEMU, Stop when the VM's files go,
// Recover at engine open, Close at engine close), Tail the log, SaveHistory into a
// checkpoint and SeedFork a fork's log from it.
package console

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
)

const (
	// LogHalf bounds each of serial.log and serial.log.1.
	LogHalf = 512 << 10
	// RotatedSuffix names the previous half of the console log.
	RotatedSuffix = ".1"
	// SockName is the console's socket in a VM's run directory.
	SockName = "console.sock"
	// HistoryFile is the console tail a checkpoint keeps for its forks.
	HistoryFile = "console.log"
	// ReconnectMs is how often a QEMU whose console connection was lost (its engine
	// died) tries the console socket again (its chardev's reconnect-ms).
	ReconnectMs = qemu.ConsoleReconnectMs
	// recordFile in a VM's run directory records who serves its console ("PID STARTTIME").
	recordFile = "console.pid"
	// keeperAcceptWait is how long a keeper waits for a QEMU to connect to a console it
	// got unconnected.
	keeperAcceptWait = time.Minute
	// keeperExitWait bounds how long removing a VM waits for the keeper serving it to
	// let go of its log.
	keeperExitWait = time.Second
)

// rotatingLog appends to path and, when path holds half bytes, renames it to
// path.1 (replacing the previous one) and starts a new path: the two never hold more
// than 2 × half bytes. Write errors (a full disk) drop the output: the console is
// best effort and must never stop its reader, which would stall the guest. Once
// opened it always holds one of the two files open (rotate opens the new one before
// closing the old), which is how Stop and Recover tell that a keeper serves it.
type rotatingLog struct {
	path string
	half int64
	f    *os.File
	size int64
}

func (r *rotatingLog) open() {
	f, err := os.OpenFile(r.path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return
	}
	r.f, r.size = f, 0
	if st, err := f.Stat(); err == nil {
		r.size = st.Size()
	}
}

func (r *rotatingLog) write(p []byte) {
	for len(p) > 0 {
		if r.f == nil {
			if r.open(); r.f == nil {
				return
			}
		}
		if r.size >= r.half {
			r.rotate()
			continue
		}
		n := int64(len(p))
		if room := r.half - r.size; n > room {
			n = room
		}
		w, _ := r.f.Write(p[:n])
		r.size += int64(w)
		if int64(w) < n {
			return // disk full or similar: drop the rest of this read
		}
		p = p[n:]
	}
}

func (r *rotatingLog) rotate() {
	old := r.f
	r.f = nil
	os.Rename(r.path, r.path+RotatedSuffix)
	if f, err := os.OpenFile(r.path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600); err == nil {
		r.f, r.size = f, 0
	}
	old.Close()
}

// setPath makes later writes and rotations use path (the VM's directory was renamed:
// the open file moved with it).
func (r *rotatingLog) setPath(path string) { r.path = path }

func (r *rotatingLog) close() {
	if r.f != nil {
		r.f.Close()
		r.f = nil
	}
}

// Tail copies the last max bytes of the console log at logPath (serial.log.1
// then serial.log) to w.
func Tail(logPath string, max int64, w io.Writer) error {
	var parts []*os.File
	var total int64
	for _, p := range []string{logPath + RotatedSuffix, logPath} {
		f, err := os.Open(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return err
		}
		parts = append(parts, f)
		total += st.Size()
	}
	skip := total - max
	for _, f := range parts {
		st, _ := f.Stat()
		if skip >= st.Size() {
			skip -= st.Size()
			continue
		}
		if skip > 0 {
			if _, err := f.Seek(skip, io.SeekStart); err != nil {
				return err
			}
			skip = 0
		}
		if _, err := io.Copy(w, f); err != nil {
			return err
		}
	}
	return nil
}

// SaveHistory keeps the tail of VM logPath's console in checkpoint directory
// dir, for its forks' logs. Best effort: a checkpoint does not fail for its console.
func SaveHistory(logPath, dir string) {
	f, err := os.OpenFile(filepath.Join(dir, HistoryFile), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	Tail(logPath, LogHalf, f)
}

// SeedFork starts fork name's console log with its checkpoint's console (from
// checkpoint directory ckDir) and a line saying where the fork begins, as the rotated
// half: the fork's own output replaces it once it fills a half. A checkpoint without
// a console history (made before it was kept) gets only the line.
func SeedFork(ckDir, ckName, logPath, name string) {
	seed(filepath.Join(ckDir, HistoryFile), logPath,
		"the console of checkpoint "+ckName+" above; ", "checkpoint "+ckName+" kept no console; ",
		"fork "+name+" starts here")
}

// SeedBoot starts the console log of VM name, restored from a boot cache entry (its
// directory dir, whose HistoryFile SaveHistory wrote), with the boot it holds and a
// line saying where the VM begins, as SeedFork does for a fork.
func SeedBoot(dir, logPath, name string) {
	seed(filepath.Join(dir, HistoryFile), logPath,
		"the boot in forkvm's boot cache above; ", "the boot cache entry kept no console; ",
		"VM "+name+" restored from it starts here")
}

// seed writes the history file hist, then the line "forkvm: ---- ABOVE STARTS ----"
// (MISSING instead of ABOVE when there is no history), to logPath's rotated half.
func seed(hist, logPath, above, missing, starts string) {
	f, err := os.OpenFile(logPath+RotatedSuffix, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	b, err := os.ReadFile(hist)
	if max := LogHalf - 256; len(b) > max { // room for the line below
		b = b[len(b)-max:]
	}
	f.Write(b)
	if len(b) > 0 && b[len(b)-1] != '\n' {
		f.Write([]byte("\n"))
	}
	if err != nil || len(b) == 0 {
		above = missing
	}
	fmt.Fprintf(f, "forkvm: ---- %s%s ----\n", above, starts)
}
