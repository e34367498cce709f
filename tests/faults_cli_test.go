package tests

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/faultclass"
	"github.com/forkvm/forkvm/serve"
)

// TestServeFaultsCLI: `forkvm serve --faults` (root, eBPF) counts each fork's page
// faults by class until ready: a fork through it has them in its line, its JSON event
// (faults, and its VM object's) and `ls --json`, `fork --faults` or not; a daemon
// without --faults refuses fork --faults before any fork starts; and serve --faults
// without root does not start, saying why.
func TestServeFaultsCLI(t *testing.T) {
	t.Parallel() // its CLI and daemons run with cliEnv's budget
	if s, err := faultclass.Open(faultclass.Options{MaxProcesses: 1}); errors.Is(err, faultclass.ErrUnavailable) {
		t.Skipf("this host or user has no eBPF fault classes: %v", err)
	} else if err != nil {
		t.Fatal(err)
	} else {
		s.Close()
	}
	home, cli, ok := cliSession(t, "fvflt-", []string{"rm", "fw", "f1", "f2", "f3", "w1", "w2"}, []string{"checkpoint", "rm", "--force", "fck"})
	// counted checks a fork's fault classes until ready: a fork reads checkpoint pages
	// (or copies them) and QEMU faults in its own memory.
	counted := func(what string, fc *api.FaultClasses) {
		t.Helper()
		if fc == nil || fc.SharedReads+fc.CopyOnWrite == 0 || fc.QEMU == 0 {
			t.Errorf("%s: fault classes %+v, want guest RAM and QEMU faults until ready", what, fc)
		}
	}
	ok("create", "fw", "--cpus", "1", "--memory-mb", "256", "--forkable")
	ok("checkpoint", "fw", "fck", "--pin")

	// serve --faults without root: no daemon, and why.
	if _, err := exec.LookPath("setpriv"); err == nil {
		bin := filepath.Join(binDir, "forkvm")
		out, err := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
			bin, "--home", filepath.Join(home, "nobody"), "serve", "--faults").CombinedOutput()
		if err == nil || !strings.Contains(string(out), "--faults") || !strings.Contains(string(out), "needs root") {
			t.Errorf("serve --faults as nobody: %v: %s", err, out)
		}
	} else {
		t.Log("serve --faults without root not checked: no setpriv")
	}

	// A daemon that does not count fault classes refuses fork --faults before forking.
	sock := serve.SocketPath(home)
	refusedWithoutServeFlag(t, home, cli, ok, "fck", "f1", "--faults")

	d := startDaemon(t, home, sock, filepath.Join(t.TempDir(), "daemon2.log"), "--faults")
	defer d.stop()
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	getJSON := func(path string, v any) {
		t.Helper()
		resp, err := hc.Get("http://forkvm" + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if err := json.NewDecoder(resp.Body).Decode(v); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d %v", path, resp.StatusCode, err)
		}
	}
	var info api.DaemonObject
	if getJSON("/v1/info", &info); !info.Faults {
		t.Errorf("GET /v1/info of serve --faults: %+v, want faults true", info)
	}
	out := ok("fork", "fck", "f1", "--faults", "--json")
	var ev api.ForkEventObject
	if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &ev); err != nil || !ev.OK || ev.VM == nil {
		t.Fatalf("fork --faults through serve --faults: %q: %v", out, err)
	}
	counted("the fork event's faults", ev.Faults)
	if ev.Faults != nil && (ev.VM.Faults == nil || *ev.VM.Faults != *ev.Faults) {
		t.Errorf("the event's VM object has faults %+v, the event %+v", ev.VM.Faults, *ev.Faults)
	}
	if ev.Faults != nil {
		t.Logf("serve --faults: f1 until ready %+v", *ev.Faults)
	}
	if out := ok("fork", "fck", "f2"); !strings.Contains(out, "faults until ready: ") || !strings.Contains(out, " copy on write, ") {
		t.Errorf("a fork's line through serve --faults: %q", out)
	}
	// A wave: every fork counted.
	for _, line := range strings.Split(strings.TrimSpace(ok("fork", "fck", "--n", "2", "--prefix", "w", "--json")), "\n") {
		var ev api.ForkEventObject
		if err := json.Unmarshal([]byte(line), &ev); err != nil || !ev.OK {
			t.Fatalf("wave line %q: %v", line, err)
		}
		counted("wave fork "+ev.Name, ev.Faults)
	}
	var vms []api.VMObject
	if err := json.Unmarshal([]byte(ok("ls", "--json")), &vms); err != nil {
		t.Fatal(err)
	}
	seen := 0
	for _, v := range vms {
		switch v.Name {
		case "f1", "f2", "w1", "w2":
			seen++
			counted("ls --json "+v.Name, v.Faults)
		case "fw":
			if v.Faults != nil {
				t.Errorf("fw was created, not forked, but has faults %+v", *v.Faults)
			}
		}
	}
	if seen != 4 {
		t.Errorf("ls --json listed %d of the 4 forks: %+v", seen, vms)
	}
	var f2 api.VMObject
	getJSON("/v1/vms/f2", &f2)
	counted("GET /v1/vms/f2", f2.Faults)
}
