package measure

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// PerfScriptFile is --perf's perf script output, in the output directory (and in a
// --trace bundle).
const PerfScriptFile = "perf-script.txt"

// PerfSession is --perf: perf record of the whole host (-a, call graphs, on
// CLOCK_MONOTONIC like every other timestamp of the run) while forks run, whose samples
// of the forks' QEMUs are kept. The forks' QEMUs run with -perfmap; before a fork is
// deleted (which removes its map) its map is kept here with the guest kernel's symbols
// in place of guest-0xADDR, and perf script reads the kept maps at the end.
type PerfSession struct {
	dir  string
	data string
	cmd  *exec.Cmd
	wait chan error

	mu   sync.Mutex
	syms map[string]*kallsyms // by checkpoint: forks share its KASLR layout
	maps map[int][]byte       // by QEMU pid: the map, renamed
}

// StartPerf starts perf record in dir (made by the caller; removed by close).
func StartPerf(dir string) (*PerfSession, error) {
	bin, err := exec.LookPath("perf")
	if err != nil {
		return nil, fmt.Errorf("--perf needs perf (Debian: apt-get install linux-perf): %w", err)
	}
	p := &PerfSession{dir: dir, data: filepath.Join(dir, "perf.data"), syms: map[string]*kallsyms{}, maps: map[int][]byte{}, wait: make(chan error, 1)}
	log, err := os.Create(filepath.Join(dir, "perf-record.log"))
	if err != nil {
		return nil, err
	}
	defer log.Close()
	// 499 Hz: no hardware PMU here, so cpu-clock; -k CLOCK_MONOTONIC lines the samples
	// up with the spans, the ftrace events and the counter tracks.
	p.cmd = exec.Command(bin, "record", "-a", "-g", "-F", "499", "-k", "CLOCK_MONOTONIC", "-o", p.data)
	p.cmd.Stdout, p.cmd.Stderr = log, log
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("perf record: %w", err)
	}
	go func() { p.wait <- p.cmd.Wait() }()
	// perf writes its header once its events are open; a refusal (paranoid, no events)
	// exits at once.
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-p.wait:
			b, _ := os.ReadFile(filepath.Join(dir, "perf-record.log"))
			return nil, fmt.Errorf("perf record exited at once (%v): %s", err, strings.TrimSpace(string(b)))
		case <-time.After(50 * time.Millisecond):
		}
		if st, err := os.Stat(p.data); err == nil && st.Size() > 0 {
			return p, nil
		}
	}
	p.stop()
	return nil, errors.New("perf record did not start within 10s")
}

// Keep saves vm's perf map, renamed with the guest kernel's symbols (read once per
// checkpoint through the agent), before vm is deleted. Errors are reported, not fatal:
// the samples remain, named guest-0xADDR.
func (p *PerfSession) Keep(ctx context.Context, ck string, vm *engine.VM) error {
	if p == nil {
		return nil
	}
	pid := vm.PID()
	raw, err := os.ReadFile(fmt.Sprintf("/tmp/perf-%d.map", pid))
	if err != nil {
		return fmt.Errorf("perf map of %s: %w", vm.Name(), err)
	}
	p.mu.Lock()
	ks := p.syms[ck]
	p.mu.Unlock()
	var kerr error
	if ks == nil {
		var text []byte
		text, kerr = vm.Output(ctx, "cat", "/proc/kallsyms")
		if kerr == nil {
			ks, kerr = parseKallsyms(text)
		}
		if kerr == nil {
			p.mu.Lock()
			p.syms[ck] = ks
			p.mu.Unlock()
		}
	}
	if ks != nil {
		raw = ks.renameMap(raw)
	}
	p.mu.Lock()
	p.maps[pid] = raw
	p.mu.Unlock()
	if kerr != nil {
		return fmt.Errorf("guest kallsyms of %s: %w", vm.Name(), kerr)
	}
	return nil
}

// stop ends perf record (SIGINT, as ^C: it writes its data and exits).
func (p *PerfSession) stop() error {
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case err := <-p.wait:
		return err
	case <-time.After(60 * time.Second):
		_ = p.cmd.Process.Kill()
		return <-p.wait
	}
}

// Script stops recording and returns perf script's text for the kept QEMUs' samples:
// their maps are put back at /tmp/perf-PID.map for perf script (never over a file that
// is there) and removed again.
func (p *PerfSession) Script(ctx context.Context) ([]byte, error) {
	if err := p.stop(); err != nil && !isInterrupted(err) {
		return nil, fmt.Errorf("perf record: %w", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.maps) == 0 {
		return nil, errors.New("perf: no fork's map was kept")
	}
	var pids []string
	for pid, m := range p.maps {
		path := fmt.Sprintf("/tmp/perf-%d.map", pid)
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			continue // a live process's own map now: leave it, its samples stay unnamed
		}
		_, err = f.Write(m)
		f.Close()
		defer os.Remove(path)
		if err != nil {
			return nil, err
		}
		pids = append(pids, strconv.Itoa(pid))
	}
	sort.Strings(pids)
	cmd := exec.CommandContext(ctx, "perf", "script", "-i", p.data, "--pid", strings.Join(pids, ","))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("perf script: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// Close removes the session's directory.
func (p *PerfSession) Close() {
	if p.cmd.ProcessState == nil {
		_ = p.stop()
	}
	os.RemoveAll(p.dir)
}

// isInterrupted reports perf record's exit on the SIGINT that stops it.
func isInterrupted(err error) bool {
	var ee *exec.ExitError
	return errors.As(err, &ee) && (ee.ExitCode() == 130 || ee.ExitCode() == -1)
}

// kallsyms is a guest kernel's symbol table, sorted by address.
type kallsyms struct {
	addrs []uint64
	names []string
}

// parseKallsyms parses /proc/kallsyms ("ADDR TYPE NAME [MODULE]"), keeping text
// symbols. All-zero addresses (kptr_restrict) are an error: nothing to name.
func parseKallsyms(text []byte) (*kallsyms, error) {
	type sym struct {
		a uint64
		n string
	}
	var syms []sym
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 || (f[1] != "t" && f[1] != "T") {
			continue
		}
		a, err := strconv.ParseUint(f[0], 16, 64)
		if err != nil || a == 0 {
			continue
		}
		syms = append(syms, sym{a, f[2]})
	}
	if len(syms) == 0 {
		return nil, errors.New("no text symbols with addresses (kptr_restrict?)")
	}
	sort.Slice(syms, func(i, j int) bool { return syms[i].a < syms[j].a })
	k := &kallsyms{}
	for _, s := range syms {
		k.addrs, k.names = append(k.addrs, s.a), append(k.names, s.n)
	}
	return k, nil
}

// kallsymsSpan bounds how far past the last symbol an address is still named by it.
const kallsymsSpan = 1 << 20

// name is "SYMBOL+0xOFF" for a guest kernel text address, "" for an address below the
// first symbol or far past the last.
func (k *kallsyms) name(a uint64) string {
	i := sort.Search(len(k.addrs), func(i int) bool { return k.addrs[i] > a }) - 1
	if i < 0 || (i == len(k.addrs)-1 && a-k.addrs[i] > kallsymsSpan) {
		return ""
	}
	return k.names[i] + "+0x" + strconv.FormatUint(a-k.addrs[i], 16)
}

// renameMap rewrites a perf map's "START SIZE guest-0xADDR" lines whose address is
// in the guest kernel to "START SIZE guest:SYMBOL+0xOFF"; other lines are kept.
func (k *kallsyms) renameMap(m []byte) []byte {
	var out bytes.Buffer
	out.Grow(len(m))
	for _, line := range bytes.SplitAfter(m, []byte("\n")) {
		f := bytes.Fields(line)
		if len(f) == 3 && bytes.HasPrefix(f[2], []byte("guest-0x")) {
			if a, err := strconv.ParseUint(string(f[2][len("guest-0x"):]), 16, 64); err == nil {
				if n := k.name(a); n != "" {
					fmt.Fprintf(&out, "%s %s guest:%s\n", f[0], f[1], n)
					continue
				}
			}
		}
		out.Write(line)
	}
	return out.Bytes()
}
