package console

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/procinfo"
)

const (
	// consoleKeeperEnv marks a process started as a console keeper. Its value says
	// which of the passed descriptors belong to which console: one count per console,
	// comma-separated, in argv's order: 1 (a listener no QEMU connected to yet) or 2
	// (a listener, then QEMU's connection). fd 3 is a pipe the keeper writes a byte to
	// once it holds every log open; the first console's descriptors start at fd 4.
	consoleKeeperEnv = "FORKVM_ENGINE_CONSOLE_KEEPER"
	// keeperReadyWait bounds how long Hub.Close waits for the keeper to take over.
	keeperReadyWait = 10 * time.Second
	// consoleKeeperArg0 is the keeper's argv[0] (what ps shows); the rest of argv are
	// the logs of the consoles it serves.
	consoleKeeperArg0 = "forkvm-console"
)

// init turns a process started by Hub.Close into the keeper: every binary that embeds
// the engine can serve as its own console keeper, so none has to be installed beside
// it. It runs before the program's main and never returns.
func init() {
	if v := os.Getenv(consoleKeeperEnv); v != "" && len(os.Args) >= 2 && os.Args[0] == consoleKeeperArg0 {
		os.Exit(runKeeper(v, os.Args[1:]))
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

// handOff starts one keeper for cons (halted for a hand-off), waits until it holds
// their logs open (so that the next engine's Recover sees it serves them, however soon
// it comes) and records it in their run directories. Nothing to hand off starts
// nothing.
func handOff(cons []*served) error {
	ready, readyW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("engine: console keeper: %w", err)
	}
	defer ready.Close()
	files := []*os.File{readyW}
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	var counts, logs []string
	var passed []*served
	for _, s := range cons {
		lf, err := s.ln.File()
		if err != nil {
			continue
		}
		files = append(files, lf)
		if s.conn == nil {
			counts = append(counts, "1")
		} else if cf, err := s.conn.File(); err == nil {
			files = append(files, cf)
			counts = append(counts, "2")
		} else {
			files = files[:len(files)-1]
			lf.Close()
			continue
		}
		logs = append(logs, *s.log.Load())
		passed = append(passed, s)
	}
	if len(passed) == 0 {
		return nil
	}
	ready.SetReadDeadline(time.Now().Add(keeperReadyWait))
	exe, err := selfExe()
	if err != nil {
		return fmt.Errorf("engine: console keeper: %w", err)
	}
	cmd := &exec.Cmd{
		Path: exe, Args: append([]string{consoleKeeperArg0}, logs...), Dir: "/",
		Env:        []string{consoleKeeperEnv + "=" + strings.Join(counts, ","), "GOMAXPROCS=1", "GOGC=25"},
		ExtraFiles: files,
		// Its own session, like QEMU's: a terminal's signals do not reach it.
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("engine: console keeper: %w", err)
	}
	go cmd.Wait() // reap it if it ends while this process runs
	readyW.Close()
	files[0] = nil
	start, _ := qemu.ProcStartTime(cmd.Process.Pid)
	for _, s := range passed {
		writeRecord(s.runDir, record{pid: cmd.Process.Pid, start: start})
	}
	if _, err := ready.Read(make([]byte, 1)); err != nil {
		// Dead, or too slow to start. The records name it: Stop waits for it if it
		// does serve them, and Recover serves them if it does not.
		return fmt.Errorf("engine: console keeper %d did not take over: %w", cmd.Process.Pid, err)
	}
	return nil
}

// handed is one console as a keeper gets it: the listener, QEMU's connection (nil when
// none was made yet) and the log.
type handed struct {
	ln, conn *os.File
	log      string
}

// runKeeper is the keeper process's body: it reads which descriptors are whose from
// layout (consoleKeeperEnv) and logs (argv) and serves them. Its exit status says only
// whether it understood its arguments.
func runKeeper(layout string, logs []string) int {
	counts := strings.Split(layout, ",")
	if len(counts) != len(logs) {
		return 2
	}
	cons := make([]handed, 0, len(logs))
	ready := os.NewFile(3, "ready")
	fd := uintptr(4)
	for i, c := range counts {
		h := handed{ln: os.NewFile(fd, SockName), log: logs[i]}
		fd++
		switch c {
		case "1":
		case "2":
			h.conn = os.NewFile(fd, "console")
			fd++
		default:
			return 2
		}
		cons = append(cons, h)
	}
	keep(cons, keeperAcceptWait, func() {
		ready.Write([]byte{1})
		ready.Close()
	})
	return 0
}

// keep serves cons until every connection is closed, waiting up to acceptWait for a
// QEMU to connect to a console handed over without one. It calls ready once it holds
// every log open (the logs it can open): from then on Stop and Recover see it serves
// them.
func keep(cons []handed, acceptWait time.Duration, ready func()) {
	logs := make([]*rotatingLog, len(cons))
	for i, h := range cons {
		logs[i] = &rotatingLog{path: h.log, half: LogHalf}
		logs[i].open()
	}
	ready()
	var wg sync.WaitGroup
	for i, h := range cons {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer logs[i].close()
			keepOne(h, logs[i], acceptWait)
		}()
	}
	wg.Wait()
}

// keepOne serves one handed console into rl, which stays open while the console is
// served: that is how Stop and Recover tell a keeper serves it.
func keepOne(h handed, rl *rotatingLog, acceptWait time.Duration) {
	ln, err := net.FileListener(h.ln)
	h.ln.Close()
	var conn net.Conn
	if h.conn != nil {
		if err == nil {
			ln.Close() // QEMU connects once; a reconnecting one is the next engine's
		}
		conn, err = net.FileConn(h.conn)
		h.conn.Close()
	} else if err == nil {
		conn, err = acceptWhileVM(ln, filepath.Dir(h.log), acceptWait)
		ln.Close()
	}
	if err != nil {
		return
	}
	defer conn.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := conn.Read(buf)
		if n > 0 {
			rl.write(buf[:n])
		}
		if err != nil {
			return
		}
	}
}

// vmPoll is how often a keeper waiting for a QEMU to connect looks whether the VM
// still exists.
const vmPoll = 200 * time.Millisecond

// acceptWhileVM accepts QEMU's connection on ln for up to wait, giving up as soon as
// the VM's directory vmDir is gone (the VM was deleted: its QEMU will never connect,
// and a keeper waiting a minute for it outlived the VM).
func acceptWhileVM(ln net.Listener, vmDir string, wait time.Duration) (net.Conn, error) {
	ul, ok := ln.(*net.UnixListener)
	if !ok {
		return ln.Accept()
	}
	end := time.Now().Add(wait)
	for {
		next := time.Now().Add(vmPoll)
		if next.After(end) {
			next = end
		}
		ul.SetDeadline(next)
		c, err := ul.Accept()
		if err == nil {
			return c, nil
		}
		if ne, ok := err.(net.Error); !ok || !ne.Timeout() || !time.Now().Before(end) {
			return nil, err
		}
		if _, serr := os.Stat(vmDir); serr != nil {
			return nil, serr
		}
	}
}

// waitKeepers waits, up to keeperExitWait, until no keeper process holds logPath (of
// the VM whose run directory is runDir) open: the one console.pid records, or, when
// there is no record (an engine killed between starting a keeper and recording it),
// those whose argv names the log. One still holding it then is killed only if it
// serves no other console (holds none of the other logs its argv names).
func waitKeepers(runDir, logPath string) {
	var ks []record
	if r, ok := readRecord(runDir); ok {
		if r.pid != os.Getpid() {
			ks = append(ks, r)
		}
	} else if logPath != "" {
		pids, _ := procinfo.ProcessesWithArg(logPath)
		for _, pid := range pids {
			args, err := procinfo.ProcessArgs(pid)
			if err != nil || len(args) < 2 || args[0] != consoleKeeperArg0 || !containsString(args[1:], logPath) {
				continue
			}
			if start, err := qemu.ProcStartTime(pid); err == nil {
				ks = append(ks, record{pid, start})
			}
		}
	}
	for _, k := range ks {
		releaseLog(k, logPath)
	}
}

// releaseLog waits for keeper k to let go of logPath; see waitKeepers.
func releaseLog(k record, logPath string) {
	deadline := time.Now().Add(keeperExitWait)
	for {
		files := openFiles(k.pid)
		if !k.alive() || !holds(files, logPath) {
			return
		}
		if time.Now().After(deadline) {
			args, _ := procinfo.ProcessArgs(k.pid)
			if len(args) < 2 || args[0] != consoleKeeperArg0 || !containsString(args[1:], logPath) {
				return // not a keeper (or not ours): never signalled
			}
			for _, other := range args[1:] {
				if other != logPath && holds(files, other) {
					return // it serves other VMs too: never ended for one
				}
			}
			syscall.Kill(k.pid, syscall.SIGKILL)
			for end := time.Now().Add(keeperExitWait); k.alive() && time.Now().Before(end); {
				time.Sleep(5 * time.Millisecond)
			}
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// openFiles is the set of files process pid holds open (their paths, as
// /proc/PID/fd names them); empty where that cannot be read.
func openFiles(pid int) map[string]bool {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	out := make(map[string]bool, len(ents))
	for _, ent := range ents {
		if l, err := os.Readlink(filepath.Join(dir, ent.Name())); err == nil && strings.HasPrefix(l, "/") {
			out[strings.TrimSuffix(l, " (deleted)")] = true
		}
	}
	return out
}

// holds reports whether files (openFiles) has either half of the console log logPath,
// by the path given or with its directory's links resolved.
func holds(files map[string]bool, logPath string) bool {
	if len(files) == 0 {
		return false
	}
	paths := []string{logPath}
	if d, err := filepath.EvalSymlinks(filepath.Dir(logPath)); err == nil {
		paths = append(paths, filepath.Join(d, filepath.Base(logPath)))
	}
	for _, p := range paths {
		if files[p] || files[p+RotatedSuffix] {
			return true
		}
	}
	return false
}

func containsString(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}
