package tests

import (
	"encoding/json"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/faultclass"
	"github.com/forkvm/forkvm/serve"
)

// TestForkCountersCLI: `forkvm fork --counters` gives each fork the kernel's account of
// its QEMU until ready, in its line, its JSON event and `ls --json`; through a daemon,
// `forkvm serve --counters` does, and fork --counters is refused by a daemon that does
// not count (before any fork starts) rather than giving forks without counters.
func TestForkCountersCLI(t *testing.T) {
	t.Parallel() // its CLI and daemons run with cliEnv's budget
	home, cli, ok := cliSession(t, "fvctr-", []string{"rm", "cw", "c1", "c2", "c3", "c4", "c5"}, []string{"checkpoint", "rm", "--force", "cck"})
	// counted checks a fork's counters as the JSON of its VM object has them.
	counted := func(what string, c *api.Counters) {
		t.Helper()
		if c == nil || c.Source == "" || c.Ready.MinorFaults <= 0 || c.Ready.TaskClock <= 0 || c.Ready.RSSShmem+c.Ready.RSSAnon <= 0 {
			t.Errorf("%s: counters %+v, want the kernel's account until ready", what, c)
		}
	}
	forkEvent := func(args ...string) api.ForkEventObject {
		t.Helper()
		var ev api.ForkEventObject
		out := ok(append([]string{"fork", "cck", "--json"}, args...)...)
		if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &ev); err != nil || !ev.OK || ev.VM == nil {
			t.Fatalf("fork %v: %q: %v", args, out, err)
		}
		return ev
	}
	ok("create", "cw", "--cpus", "1", "--memory-mb", "256", "--forkable")
	ok("checkpoint", "cw", "cck", "--pin")

	// Without a daemon: the CLI's engine counts for this fork.
	ev := forkEvent("c1", "--counters")
	counted("fork --counters event", ev.VM.Counters)
	var vms []api.VMObject
	if err := json.Unmarshal([]byte(ok("ls", "--json")), &vms); err != nil {
		t.Fatal(err)
	}
	for _, v := range vms {
		switch v.Name {
		case "c1":
			counted("ls --json c1", v.Counters)
		case "cw":
			if v.Counters != nil {
				t.Errorf("cw was created without --counters but has counters %+v", v.Counters)
			}
		}
	}
	if out := ok("fork", "cck", "c2", "--counters"); !strings.Contains(out, "kernel until ready (") || !strings.Contains(out, "minor / ") {
		t.Errorf("fork --counters line: %q", out)
	}

	// fork --faults (root, eBPF): the fork's page faults by class until ready.
	switch out, errs, code := cli(nil, "fork", "cck", "c5", "--faults", "--json"); {
	case code != 0 && strings.Contains(errs, "unavailable"):
		t.Logf("fork --faults not checked: this host has no eBPF fault classes: %s", errs)
	case code != 0:
		t.Errorf("fork --faults: exit %d: %s", code, errs)
	default:
		var ev struct {
			api.ForkEventObject
			Faults *faultclass.Summary `json:"faults"`
		}
		if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &ev); err != nil || !ev.OK || ev.Faults == nil ||
			ev.Faults.SharedReads+ev.Faults.CopyOnWrite == 0 || ev.Faults.QEMU == 0 || ev.VM == nil || ev.VM.Faults == nil || *ev.VM.Faults != *ev.Faults {
			t.Errorf("fork --faults event %q: %v", out, err)
		} else {
			t.Logf("fork --faults until ready: %+v", *ev.Faults)
		}
	}

	// A daemon that does not count refuses fork --counters before forking.
	sock := serve.SocketPath(home)
	refusedWithoutServeFlag(t, home, cli, ok, "cck", "c3", "--counters")

	// forkvm serve --counters: every fork it makes is counted, --counters or not.
	d := startDaemon(t, home, sock, filepath.Join(t.TempDir(), "daemon2.log"), "--counters")
	defer d.stop()
	ev = forkEvent("c3")
	counted("serve --counters fork event", ev.VM.Counters)
	ev = forkEvent("c4", "--counters")
	counted("serve --counters fork --counters event", ev.VM.Counters)
}

// refusedWithoutServeFlag checks that a daemon started without flag (serve --counters,
// serve --faults) refuses `fork CK NAME flag` before forking: the error names the serve
// flag and no VM NAME is made.
func refusedWithoutServeFlag(t *testing.T, home string, cli func(io.Reader, ...string) (string, string, int), ok func(...string) string, ck, name, flag string) {
	t.Helper()
	d := startDaemon(t, home, serve.SocketPath(home), filepath.Join(t.TempDir(), "daemon.log"))
	defer d.stop()
	if _, errs, code := cli(nil, "fork", ck, name, flag); code == 0 || !strings.Contains(errs, "serve "+flag) {
		t.Errorf("fork %s through a daemon without serve %s: %d %q", flag, flag, code, errs)
	}
	if out := ok("ls"); strings.Contains(out, name+" ") {
		t.Errorf("a refused fork %s made %s:\n%s", flag, name, out)
	}
}
