// Package console is the guest console, bounded: the console keeper and its log.
//
// A guest prints as fast as it likes on its serial port, and QEMU's file chardev
// appends without limit: a hostile guest fills the host's disk. So QEMU never writes
// the log itself. Its serial port is a unix socket client of a console keeper, a small
// process of its own (this binary, re-executed: see init) that the engine starts
// before each QEMU. The keeper appends what it reads to StateDir/vms/NAME/serial.log
// and rotates it to serial.log.1 when it reaches LogHalf, so the console
// takes at most 2 × LogHalf on disk: the last output, older output dropped.
//
// The keeper lives as long as its QEMU, not as long as the engine: VMs outlive the
// process that made them, and so does the cap. It exits when QEMU closes the
// connection (QEMU exited) or when no QEMU connected within keeperAcceptWait. If the
// keeper is killed, QEMU's socket chardev drops the console output: nothing is written
// anywhere until the VM is restarted. A guest that prints faster than the keeper
// writes is slowed down (the socket fills), never the host.
//
// The surface: Start a keeper before QEMU, Stop it when the VM's files go, Tail the
// log, SaveHistory into a checkpoint and SeedFork a fork's log from it.
package console

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/procinfo"
)

const (
	// LogHalf bounds each of serial.log and serial.log.1.
	LogHalf = 512 << 10
	// RotatedSuffix names the previous half of the console log.
	RotatedSuffix = ".1"
	// consoleKeeperEnv marks a process started as a console keeper.
	consoleKeeperEnv = "FORKVM_ENGINE_CONSOLE_KEEPER"
	// consoleKeeperArg0 is the keeper's argv[0] (what ps shows); argv[1] is the log.
	consoleKeeperArg0 = "forkvm-console"
	// keeperAcceptWait is how long a keeper waits for its QEMU to connect.
	keeperAcceptWait = time.Minute
	// SockName is the console's socket in a VM's run directory.
	SockName = "console.sock"
	// HistoryFile is the console tail a checkpoint keeps for its forks.
	HistoryFile = "console.log"
	// consoleKeeperFile in a VM's run directory records its keeper ("PID STARTTIME").
	consoleKeeperFile = "console.pid"
	// keeperExitWait bounds how long removing a VM waits for its keeper to be gone.
	keeperExitWait = time.Second
)

// init turns a process started by Start into the keeper: every binary
// that embeds the engine can serve as its own console keeper, so none has to be
// installed beside it. It runs before the program's main and never returns.
func init() {
	if os.Getenv(consoleKeeperEnv) == "1" && len(os.Args) == 2 && os.Args[0] == consoleKeeperArg0 {
		os.Exit(runConsoleKeeper(os.Args[1]))
	}
}

// selfExe is the running binary, for re-executing it as a keeper (on Linux the
// kernel's link, which works even when the file was replaced or deleted).
func selfExe() (string, error) {
	if runtime.GOOS == "linux" {
		return "/proc/self/exe", nil
	}
	return os.Executable()
}

// Start listens on sock and starts the keeper that appends what its QEMU
// sends there to logPath. The listener exists before the keeper runs, so QEMU can
// connect as soon as it starts. The caller kills the returned process if QEMU never
// starts (else it exits on its own after keeperAcceptWait).
func Start(sock, logPath string) (*os.Process, error) {
	if err := os.Remove(sock); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("engine: console socket: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("engine: console socket: %w", err)
	}
	ln.SetUnlinkOnClose(false)
	lf, err := ln.File()
	ln.Close()
	if err != nil {
		os.Remove(sock)
		return nil, fmt.Errorf("engine: console socket: %w", err)
	}
	defer lf.Close()
	exe, err := selfExe()
	if err != nil {
		os.Remove(sock)
		return nil, fmt.Errorf("engine: console keeper: %w", err)
	}
	cmd := &exec.Cmd{
		Path: exe, Args: []string{consoleKeeperArg0, logPath}, Dir: "/",
		Env:        []string{consoleKeeperEnv + "=1", "GOMAXPROCS=1", "GOGC=25"},
		ExtraFiles: []*os.File{lf}, // fd 3
		// Its own session, like QEMU's: a terminal's signals do not reach it.
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	if err := cmd.Start(); err != nil {
		os.Remove(sock)
		return nil, fmt.Errorf("engine: console keeper: %w", err)
	}
	p := cmd.Process
	go cmd.Wait() // reap it if it ends while this engine runs
	start, _ := qemu.ProcStartTime(p.Pid)
	os.WriteFile(filepath.Join(filepath.Dir(sock), consoleKeeperFile), []byte(fmt.Sprintf("%d %d\n", p.Pid, start)), 0o600)
	return p, nil
}

// Stop ends the keeper of the VM whose run directory is runDir and whose
// console log is logPath, when the VM's files are removed (its QEMU is gone, so the
// keeper is about to exit anyway), and waits up to keeperExitWait for it to be gone:
// nothing of a deleted VM outlives its deletion. The keeper recorded in runDir is only
// signalled while its start time matches the record. An engine killed between starting
// a keeper and recording it leaves one unrecorded: it is found by its exact argv
// (argv[0] forkvm-console, argv[1] this VM's log, a path in this state directory).
func Stop(runDir, logPath string) {
	type keeper struct {
		pid   int
		start uint64
	}
	var ks []keeper
	if b, err := os.ReadFile(filepath.Join(runDir, consoleKeeperFile)); err == nil {
		var k keeper
		if _, err := fmt.Sscan(string(b), &k.pid, &k.start); err == nil && k.pid > 1 {
			ks = append(ks, k)
		}
	}
	if len(ks) == 0 && logPath != "" {
		pids, _ := procinfo.ProcessesWithArg(logPath)
		for _, pid := range pids {
			args, err := procinfo.ProcessArgs(pid)
			if err != nil || len(args) != 2 || args[0] != consoleKeeperArg0 || args[1] != logPath {
				continue
			}
			if start, err := qemu.ProcStartTime(pid); err == nil {
				ks = append(ks, keeper{pid, start})
			}
		}
	}
	for _, k := range ks {
		same := func() bool { got, err := qemu.ProcStartTime(k.pid); return err == nil && got == k.start }
		if !same() {
			continue
		}
		syscall.Kill(k.pid, syscall.SIGKILL)
		for deadline := time.Now().Add(keeperExitWait); same() && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// runConsoleKeeper is the keeper's body: accept QEMU's connection on fd 3 and copy it
// into the rotating log until QEMU closes it. Its exit status says only whether it
// got a connection.
func runConsoleKeeper(logPath string) int {
	ln, err := net.FileListener(os.NewFile(3, "console.sock"))
	if err != nil {
		return 2
	}
	if ul, ok := ln.(*net.UnixListener); ok {
		ul.SetDeadline(time.Now().Add(keeperAcceptWait))
	}
	conn, err := ln.Accept()
	ln.Close()
	if err != nil {
		return 1
	}
	defer conn.Close()
	rl := &rotatingLog{path: logPath, half: LogHalf}
	defer rl.close()
	buf := make([]byte, 32<<10)
	for {
		n, err := conn.Read(buf)
		if n > 0 {
			rl.write(buf[:n])
		}
		if err != nil {
			return 0
		}
	}
}

// rotatingLog appends to path and, when path holds half bytes, renames it to
// path.1 (replacing the previous one) and starts a new path: the two never hold more
// than 2 × half bytes. Write errors (a full disk) drop the output: the console is
// best effort and must never stop the keeper reading, which would stall the guest.
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
	r.f.Close()
	r.f = nil
	os.Rename(r.path, r.path+RotatedSuffix)
	f, err := os.OpenFile(r.path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return
	}
	r.f, r.size = f, 0
}

func (r *rotatingLog) close() {
	if r.f != nil {
		r.f.Close()
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
	f, err := os.OpenFile(logPath+RotatedSuffix, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	hist, err := os.ReadFile(filepath.Join(ckDir, HistoryFile))
	if max := LogHalf - 256; len(hist) > max { // room for the line below
		hist = hist[len(hist)-max:]
	}
	f.Write(hist)
	if len(hist) > 0 && hist[len(hist)-1] != '\n' {
		f.Write([]byte("\n"))
	}
	what := "the console of checkpoint " + ckName + " above; "
	if err != nil || len(hist) == 0 {
		what = "checkpoint " + ckName + " kept no console; "
	}
	fmt.Fprintf(f, "forkvm: ---- %sfork %s starts here ----\n", what, name)
}
