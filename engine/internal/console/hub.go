package console

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
)

// ErrHubClosed is returned by Hub.Start once the Hub's engine closed (or when there is
// no Hub): a VM started then would have nobody to serve its console.
var ErrHubClosed = errors.New("console: hub closed")

// Hub serves the consoles of one engine's VMs in the engine's process (see the package
// doc): one listener and one goroutine per VM, no process. The engine makes it, and
// Close hands what is still open to one keeper process. Its methods are safe for
// concurrent use; a nil Hub serves nothing (Stop still waits for keepers).
type Hub struct {
	mu     sync.Mutex
	cons   map[string]*served // by run directory
	closed bool
	self   record
}

// NewHub is an empty Hub serving from this process.
func NewHub() *Hub {
	start, _ := qemu.ProcStartTime(os.Getpid())
	return &Hub{cons: map[string]*served{}, self: record{pid: os.Getpid(), start: start}}
}

// Console names a VM's console for Recover: its run directory (the socket is
// RunDir/SockName) and its log.
type Console struct {
	RunDir, Log string
}

// halt says why a console's goroutine is being stopped.
type halt int

const (
	running halt = iota
	// haltStop: the VM is gone (Stop): close everything.
	haltStop
	// haltHandoff: the engine closes (Close): keep the listener and the connection,
	// unread bytes included, for the keeper.
	haltHandoff
)

// served is one console the Hub serves. Its goroutine (serve) owns the reading; mu
// guards what Stop and Close look at.
type served struct {
	runDir string
	ln     *net.UnixListener
	log    atomic.Pointer[string]
	done   chan struct{}

	mu   sync.Mutex
	halt halt
	// conn is QEMU's connection while it is open.
	conn *net.UnixConn
	// connected: a QEMU connected at least once.
	connected bool
}

// longAgo is a deadline that has passed: it wakes a blocked Accept or Read at once.
var longAgo = time.Unix(1, 0)

// Start listens on sock (in a VM's run directory) and serves it: QEMU's connection is
// appended to logPath, rotated. The listener exists when Start returns, so QEMU can
// connect as soon as it starts. A console the Hub served before in the same run
// directory (an earlier QEMU of the VM) is ended first. console.pid records this
// process as the one serving it.
func (h *Hub) Start(sock, logPath string) error {
	if h == nil {
		return ErrHubClosed
	}
	runDir := filepath.Dir(sock)
	h.end(runDir)
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("engine: console socket: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return fmt.Errorf("engine: console socket: %w", err)
	}
	// The socket file stays when the listener closes: a keeper or QEMU may still use it.
	ln.SetUnlinkOnClose(false)
	s := &served{runDir: runDir, ln: ln, done: make(chan struct{})}
	s.log.Store(&logPath)
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		ln.Close()
		os.Remove(sock)
		return ErrHubClosed
	}
	h.cons[runDir] = s
	h.mu.Unlock()
	writeRecord(runDir, h.self)
	go s.serve()
	return nil
}

// Rename follows a VM whose run directory and log moved (a warm-pool claim renames
// them): the console served in oldRunDir is now the one in newRunDir, written to
// newLog. The open socket and log file moved with their directories. QEMU keeps the
// socket path it was started with, so a connection lost later (the engine killed) is
// not served again for a renamed VM.
func (h *Hub) Rename(oldRunDir, newRunDir, newLog string) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	s := h.cons[oldRunDir]
	if s == nil {
		return
	}
	delete(h.cons, oldRunDir)
	s.runDir = newRunDir
	s.log.Store(&newLog)
	h.cons[newRunDir] = s
}

// Stop ends the serving of the console in runDir whose log is logPath, when the VM's
// files are removed (its QEMU is gone): once it returns, nothing writes that log. The
// Hub's own copy is ended and waited for; a keeper process serving it (recorded in
// runDir, or when no record is left one found by its argv) is waited for, up to
// keeperExitWait, until it no longer holds the log open, which it does as soon as it
// reads the dead QEMU's end of the connection. A keeper is killed only if it still
// holds the log then and serves no other VM.
func (h *Hub) Stop(runDir, logPath string) {
	if h != nil {
		h.end(runDir)
	}
	waitKeepers(runDir, logPath)
}

// end stops and forgets the Hub's copy of the console in runDir, if it has one.
func (h *Hub) end(runDir string) {
	h.mu.Lock()
	s := h.cons[runDir]
	delete(h.cons, runDir)
	h.mu.Unlock()
	if s != nil {
		s.stop(haltStop)
	}
}

// Recover serves, at engine open, the consoles of running VMs that no live process
// serves: their engine died (its Hub with it) or their keeper was killed. It listens
// on their sockets again, and their QEMUs reconnect (within ReconnectMs). A console
// counts as served when the process console.pid records is alive and holds its log
// open. Consoles this Hub already serves are left as they are.
func (h *Hub) Recover(cons []Console) error {
	if h == nil {
		if len(cons) == 0 {
			return nil
		}
		return ErrHubClosed
	}
	held := map[record]map[string]bool{} // open files, read once per keeper
	var errs []error
	for _, c := range cons {
		h.mu.Lock()
		_, ok := h.cons[c.RunDir]
		h.mu.Unlock()
		if ok {
			continue
		}
		if r, ok := readRecord(c.RunDir); ok && r.pid != os.Getpid() && r.alive() {
			files, ok := held[r]
			if !ok {
				files = openFiles(r.pid)
				held[r] = files
			}
			if holds(files, c.Log) {
				continue
			}
		}
		if err := h.Start(filepath.Join(c.RunDir, SockName), c.Log); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", c.RunDir, err))
		}
	}
	return errors.Join(errs...)
}

// Close ends the Hub: every console still open (QEMU connected, or not yet connected)
// is handed to one keeper process, its listener and QEMU's connection passed as they
// are (bytes not yet read stay in the socket for the keeper), and console.pid of each
// names the keeper. Consoles whose QEMU already closed its connection are dropped
// (their QEMU exited). Later Starts fail with ErrHubClosed. The error says why the
// keeper could not start: those consoles go unserved until the next engine's Recover.
func (h *Hub) Close() error {
	if h == nil {
		return nil
	}
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil
	}
	h.closed = true
	cons := make([]*served, 0, len(h.cons))
	for _, s := range h.cons {
		cons = append(cons, s)
	}
	h.cons = nil
	h.mu.Unlock()
	for _, s := range cons {
		s.signal(haltHandoff)
	}
	var pass []*served
	for _, s := range cons {
		<-s.done
		if s.conn != nil || !s.connected {
			pass = append(pass, s)
		}
	}
	sort.Slice(pass, func(i, j int) bool { return pass[i].runDir < pass[j].runDir })
	err := handOff(pass)
	for _, s := range cons {
		if s.conn != nil {
			s.conn.Close()
		}
		s.ln.Close()
	}
	return err
}

// serve accepts QEMU's connections and copies each into the log until halted. A
// connection QEMU closes (it exited, or it will reconnect) sends it back to accepting.
func (s *served) serve() {
	defer close(s.done)
	buf := make([]byte, 8<<10)
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if s.halted() {
				return
			}
			// Out of descriptors and the like: a console is not worth a busy loop.
			time.Sleep(100 * time.Millisecond)
			continue
		}
		s.mu.Lock()
		s.conn, s.connected = c, true
		why := s.halt
		if why == haltStop {
			c.Close()
			s.conn = nil
		}
		s.mu.Unlock()
		if why != running || !s.copy(c, buf) {
			return
		}
	}
}

// copy appends what c delivers to the log until it ends; false when halted (the
// connection is then closed for Stop, kept open for a hand-off).
func (s *served) copy(c *net.UnixConn, buf []byte) bool {
	rl := &rotatingLog{path: *s.log.Load(), half: LogHalf}
	defer rl.close()
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if p := *s.log.Load(); p != rl.path {
				rl.setPath(p)
			}
			rl.write(buf[:n])
		}
		if err != nil {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.halt == haltHandoff {
				return false
			}
			c.Close()
			s.conn = nil
			return s.halt == running
		}
	}
}

func (s *served) halted() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.halt != running
}

// signal tells serve to stop, waking it from Accept or Read. A hand-off only wakes a
// Read (a deadline), so that no byte is taken from the socket that the log does not get.
func (s *served) signal(why halt) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.halt = why
	s.ln.SetDeadline(longAgo)
	if s.conn != nil {
		if why == haltStop {
			s.conn.Close()
		} else {
			s.conn.SetReadDeadline(longAgo)
		}
	}
}

// stop halts serve, waits for it and, for Stop, closes the listener.
func (s *served) stop(why halt) {
	s.signal(why)
	<-s.done
	if why == haltStop {
		s.ln.Close()
	}
}

// record is a process as console.pid names it: pid and start time (a pid alone may
// have been reused).
type record struct {
	pid   int
	start uint64
}

// alive reports whether the recorded process still runs.
func (r record) alive() bool {
	got, err := qemu.ProcStartTime(r.pid)
	return err == nil && got == r.start
}

func writeRecord(runDir string, r record) {
	os.WriteFile(filepath.Join(runDir, recordFile), []byte(fmt.Sprintf("%d %d\n", r.pid, r.start)), 0o600)
}

func readRecord(runDir string) (record, bool) {
	b, err := os.ReadFile(filepath.Join(runDir, recordFile))
	if err != nil {
		return record{}, false
	}
	var r record
	if _, err := fmt.Sscan(string(b), &r.pid, &r.start); err != nil || r.pid <= 1 {
		return record{}, false
	}
	return r, true
}
