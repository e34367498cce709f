package tests

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// consoleCap is the most the console log of a VM may take on the host (serial.log and
// its rotated half; the engine's documented bound).
const consoleCap = 1 << 20

// consoleBytes is what a VM's console takes on disk.
func consoleBytes(t *testing.T, home, name string) int64 {
	t.Helper()
	var n int64
	for _, f := range []string{"serial.log", "serial.log.1"} {
		if st, err := os.Stat(filepath.Join(home, "vms", name, f)); err == nil {
			n += st.Size()
		}
	}
	return n
}

// waitConsole returns vm's console log once it holds want, or as it is after 30 s.
// An exec returns when the guest's UART took its output; the host reads the console
// and writes its log after that, later on a loaded host (the end of a 1.25 MiB flood
// was some KiB behind on one: what the console socket's buffers held).
func waitConsole(t *testing.T, ctx context.Context, vm *engine.VM, want string) string {
	t.Helper()
	var logs bytes.Buffer
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		logs.Reset()
		if err := vm.Logs(ctx, false, &logs); err != nil {
			t.Fatal(err)
		}
		if s := logs.String(); strings.Contains(s, want) || time.Now().After(deadline) {
			return s
		}
	}
}

// TestGuestAbuse is a hostile guest root: it floods its console (the host keeps at
// most consoleCap of it, the end included), and sends PID 1 (the agent) the signals
// that used to kill it (the VM keeps answering). A fork's console starts with its
// checkpoint's. A guest that panics its kernel is listed dead with the panic's line.
func TestGuestAbuse(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 256, 0)

	// 1.25 MiB: more than the cap, and not long under TCG (the emulated UART is slow).
	t0 := time.Now()
	mustRun(t, w, "head -c 1310720 /dev/zero | tr '\\0' A > /dev/console; echo; echo FLOOD-END > /dev/console")
	t.Logf("1.25 MiB through the console in %v", time.Since(t0).Round(time.Millisecond))
	if n := consoleBytes(t, env.Home, "w"); n > consoleCap {
		t.Errorf("console log of w takes %d bytes after a 1.25 MiB flood, cap %d", n, consoleCap)
	}
	if s := waitConsole(t, ctx, w, "FLOOD-END"); !strings.HasSuffix(strings.TrimSpace(s), "FLOOD-END") || len(s) > consoleCap {
		t.Errorf("logs: %d bytes, ending %q", len(s), s[max(0, len(s)-40):])
	}
	if n := consoleBytes(t, env.Home, "w"); n > consoleCap {
		t.Errorf("console log of w takes %d bytes after the flood's end was logged, cap %d", n, consoleCap)
	}
	var logs bytes.Buffer

	for _, sig := range []string{"TERM", "QUIT", "SEGV", "HUP", "INT", "ABRT", "BUS", "USR1", "PIPE"} {
		if _, errs, code := run(t, w, "kill -"+sig+" 1"); code != 0 {
			t.Fatalf("kill -%s 1: exit %d: %s", sig, code, errs)
		}
		if got := mustRun(t, w, "echo alive"); got != "alive" {
			t.Fatalf("after kill -%s 1: %q", sig, got)
		}
	}
	if st := w.Info().State; st != engine.StateRunning {
		t.Fatalf("w is %s after the signals", st)
	}
	logs.Reset()
	w.Logs(ctx, false, &logs)
	if !strings.Contains(logs.String(), "PID 1 ignores terminated") {
		t.Errorf("the console does not say PID 1 ignored SIGTERM: %q", logs.String()[max(0, logs.Len()-600):])
	}

	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f1"})
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f, "echo FORK-SAYS-HI > /dev/console")
	s := waitConsole(t, ctx, f, "FORK-SAYS-HI")
	i, j, k := strings.Index(s, "FLOOD-END"), strings.Index(s, "fork f1 starts here"), strings.Index(s, "FORK-SAYS-HI")
	if i < 0 || j < i || k < j {
		t.Errorf("fork console: checkpoint's output at %d, fork line at %d, fork's output at %d; want in that order", i, j, k)
	}

	// A guest whose kernel panics (the end of a PID 1 that dies) is dead, saying so.
	p, err := e.Create(ctx, engine.Spec{Name: "p", CPUs: 1, MemoryMiB: 128})
	if err != nil {
		t.Fatal(err)
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, _ = p.Exec(pctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "echo c > /proc/sysrq-trigger"}}) // ends with the VM
	cancel()
	waitDead(t, p, 60*time.Second)
	if r := p.Info().Reason; !strings.HasPrefix(r, "guest kernel panic: ") || !strings.Contains(r, "sysrq") {
		t.Errorf("a guest kernel panic: reason %q, want \"guest kernel panic: ...sysrq...\"", r)
	}
	deleteAll(t, env)
}
