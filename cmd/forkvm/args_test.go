package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/urfave/cli/v3"
)

// parsed runs the CLI on args with every action replaced by one that records what the
// command received: its path, positional arguments and the named flags' values.
func parsed(t *testing.T, args []string, flags ...string) (path string, pos []string, vals map[string]string, err error) {
	t.Helper()
	app := newApp()
	var walk func(c *cli.Command)
	walk = func(c *cli.Command) {
		if c.Action != nil {
			c.Action = func(ctx context.Context, cmd *cli.Command) error {
				path, pos, vals = cmd.FullName(), cmd.Args().Slice(), map[string]string{}
				for _, f := range flags {
					if cmd.IsSet(f) {
						vals[f] = fmt.Sprint(cmd.Value(f))
					}
				}
				return nil
			}
		}
		for _, s := range c.Commands {
			walk(s)
		}
	}
	walk(app)
	app.Writer, app.ErrWriter = &strings.Builder{}, &strings.Builder{}
	err = app.Run(context.Background(), append([]string{"forkvm"}, args...))
	return path, pos, vals, err
}

// TestFlagsAfterNames: one rule everywhere: flags may follow the names, "--" ends the
// flags, and exec's command (its second positional) ends them too.
func TestFlagsAfterNames(t *testing.T) {
	tests := []struct {
		args  []string
		flags []string
		pos   []string
		vals  map[string]string
	}{
		{[]string{"exec", "w1", "--timeout", "1s", "--", "sleep", "10"}, []string{"timeout"},
			[]string{"w1", "sleep", "10"}, map[string]string{"timeout": (time.Second).String()}},
		{[]string{"exec", "--timeout", "1s", "w1", "sleep", "10"}, []string{"timeout"},
			[]string{"w1", "sleep", "10"}, map[string]string{"timeout": (time.Second).String()}},
		{[]string{"exec", "w1", "ls", "-la", "--timeout", "1s"}, []string{"timeout"},
			[]string{"w1", "ls", "-la", "--timeout", "1s"}, map[string]string{}},
		{[]string{"exec", "w1", "--", "--weird", "x"}, nil, []string{"w1", "--weird", "x"}, map[string]string{}},
		{[]string{"exec", "w1", "--", "--", "x"}, nil, []string{"w1", "--", "x"}, map[string]string{}},
		{[]string{"checkpoint", "w1", "ck1", "--pin"}, []string{"pin"}, []string{"w1", "ck1"}, map[string]string{"pin": "true"}},
		{[]string{"fork", "ck1", "--n", "8", "--prefix", "g"}, []string{"n", "prefix"}, []string{"ck1"},
			map[string]string{"n": "8", "prefix": "g"}},
		{[]string{"checkpoint", "rm", "ck1", "--force"}, []string{"force"}, []string{"ck1"}, map[string]string{"force": "true"}},
		{[]string{"rm", "a", "b", "--dead"}, []string{"dead"}, []string{"a", "b"}, map[string]string{"dead": "true"}},
		// An -e value is one entry, commas and all (PATH-like lists): it was split at
		// each comma into X=a and a bare b.
		{[]string{"exec", "-e", "X=a,b", "--env", "Y=1", "w1", "true"}, []string{"env"}, []string{"w1", "true"},
			map[string]string{"env": "[X=a,b Y=1]"}},
		// A --warm-up value is one argv word: "echo a,b" was two.
		{[]string{"warm", "ck", "2", "--restored", "--warm-up", "sh", "--warm-up", "-c", "--warm-up", "echo a,b"}, []string{"warm-up"},
			[]string{"ck", "2"}, map[string]string{"warm-up": "[sh -c echo a,b]"}},
	}
	for _, tt := range tests {
		_, pos, vals, err := parsed(t, tt.args, tt.flags...)
		if err != nil || !reflect.DeepEqual(pos, tt.pos) || !reflect.DeepEqual(vals, tt.vals) {
			t.Errorf("forkvm %s: args %q flags %v err %v; want %q %v", strings.Join(tt.args, " "), pos, vals, err, tt.pos, tt.vals)
		}
	}
}

// helpOf runs the CLI on args and returns what it printed.
func helpOf(t *testing.T, args ...string) (string, error) {
	t.Helper()
	app := newApp()
	var out strings.Builder
	app.Writer, app.ErrWriter = &out, &out
	err := app.Run(context.Background(), append([]string{"forkvm"}, args...))
	return out.String(), err
}

// TestHelp: help reaches every command however it is asked for, a command's flags are
// not listed as its subcommands' global options, and no line is wider than 80 columns.
func TestHelp(t *testing.T) {
	for _, tc := range []struct {
		args      []string
		want, not []string
	}{
		{[]string{"help", "image", "create"}, []string{"forkvm image create - ", "--debian"}, []string{"forkvm help"}},
		{[]string{"image", "help"}, []string{"forkvm image - ", "COMMANDS:", "create"}, nil},
		{[]string{"checkpoint", "help"}, []string{"forkvm checkpoint - ", "rm ", "--pin"}, nil},
		{[]string{"checkpoint", "rm", "--help"}, []string{"--force"}, []string{"--pin", "--handoff", "--json"}},
		{[]string{"fork", "--help"}, []string{"--n int", "--publish PORTS"}, []string{"   -n int"}},
		{[]string{"help", "exec"}, []string{"forkvm exec - "}, nil},
	} {
		out, err := helpOf(t, tc.args...)
		if err != nil {
			t.Errorf("%q: %v", tc.args, err)
		}
		for _, w := range tc.want {
			if !strings.Contains(out, w) {
				t.Errorf("%q: no %q in:\n%s", tc.args, w, out)
			}
		}
		for _, n := range tc.not {
			if strings.Contains(out, n) {
				t.Errorf("%q: %q in:\n%s", tc.args, n, out)
			}
		}
	}
	if _, err := helpOf(t, "checkpoint", "rm", "--pin", "ck"); err == nil {
		t.Error("checkpoint rm --pin was accepted")
	}
	if _, err := helpOf(t, "help", "nope"); err == nil {
		t.Error("help nope: no error")
	}
	var walk func(path []string, c *cli.Command)
	walk = func(path []string, c *cli.Command) {
		out, _ := helpOf(t, append(append([]string{}, path...), "--help")...)
		for _, l := range strings.Split(out, "\n") {
			if len(l) > helpWidth {
				t.Errorf("forkvm %s --help: a line of %d columns: %q", strings.Join(path, " "), len(l), l)
			}
		}
		for _, s := range c.Commands {
			walk(append(append([]string{}, path...), s.Name), s)
		}
	}
	walk(nil, newApp())
}

// TestWarmWithoutDaemon: warm is refused before an engine is opened (which would take
// the state directory's lock, create it and run recovery for nothing).
func TestWarmWithoutDaemon(t *testing.T) {
	home := filepath.Join(t.TempDir(), "home")
	out, err := helpOf(t, "--home", home, "warm", "ck", "2")
	if err == nil || !strings.Contains(err.Error(), "forkvm serve") {
		t.Fatalf("warm without a daemon: %v (%s)", err, out)
	}
	if _, err := os.Stat(home); !os.IsNotExist(err) {
		t.Errorf("warm touched the state directory: %v", err)
	}
}

// TestForkCountRefusedFirst: a fork count past engine.MaxForks is refused by the
// engine's rule before --publish is expanded for every fork or an engine is opened.
func TestForkCountRefusedFirst(t *testing.T) {
	for _, n := range []string{"4097", "1000000000"} {
		home := filepath.Join(t.TempDir(), "home")
		out, err := helpOf(t, "--home", home, "fork", "ck", "--n", n, "--prefix", "g", "--publish", "8000:80")
		if !errors.Is(err, engine.ErrInvalidSpec) || !strings.Contains(err.Error(), "1..4096") {
			t.Fatalf("fork --n %s: %v (%s)", n, err, out)
		}
		if _, err := os.Stat(home); !os.IsNotExist(err) {
			t.Errorf("fork --n %s touched the state directory: %v", n, err)
		}
	}
}

// TestCreateMemoryLimitReachesEngine: create's --memory-limit-mb is the VM spec's
// memory limit: a value the engine refuses (under 64 MiB) comes back as its
// ErrInvalidSpec naming the limit, before anything boots.
func TestCreateMemoryLimitReachesEngine(t *testing.T) {
	home := filepath.Join(t.TempDir(), "h")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	app := newApp()
	app.Writer, app.ErrWriter = &strings.Builder{}, &strings.Builder{}
	err := app.Run(ctx, []string{"forkvm", "--home", home, "create", "x", "--memory-limit-mb", "32"})
	if !errors.Is(err, engine.ErrInvalidSpec) || !strings.Contains(err.Error(), "memory limit") {
		t.Errorf("create --memory-limit-mb 32: %v, want ErrInvalidSpec about the memory limit", err)
	}
}

// TestErrorHint: an admission refusal points to forkvm budget; other errors get no hint.
func TestErrorHint(t *testing.T) {
	refusal := fmt.Errorf("create w1: %w", &engine.AdmissionError{Resource: "vcpu", Requested: 2, Budget: 16})
	if h := errorHint(refusal); !strings.Contains(h, "forkvm budget") {
		t.Errorf("admission hint %q", h)
	}
	if h := errorHint(engine.ErrNotFound); h != "" {
		t.Errorf("hint for not found: %q", h)
	}
}

// TestForkWaveNeedsNoPrefix: `forkvm fork ck1 --n 48` (the README's wave) is a request
// the engine names (SOURCE-TAG-1..48): it reaches the engine, which says there is no
// ck1, where it once stopped at "--n 48 needs --prefix". A request the rules refuse
// (a NAME for a wave) is refused before an engine is opened.
func TestForkWaveNeedsNoPrefix(t *testing.T) {
	home := filepath.Join(t.TempDir(), "home")
	out, err := helpOf(t, "--home", home, "fork", "ck1", "--n", "48")
	if !errors.Is(err, engine.ErrNotFound) {
		t.Fatalf("fork ck1 --n 48: %v (%s), want the engine's not found", err, out)
	}
	// The README's fleet line: the wave is named as a local one, so what stops it here
	// is that no daemon runs, not its naming.
	out, err = helpOf(t, "--home", home, "fork", "ck1", "--n", "48", "--fleet", "--spread")
	if err == nil || strings.Contains(err.Error(), "prefix") {
		t.Fatalf("fork ck1 --n 48 --fleet --spread: %v (%s), want the missing daemon", err, out)
	}
	home = filepath.Join(t.TempDir(), "home")
	out, err = helpOf(t, "--home", home, "fork", "ck1", "w1", "--n", "2")
	if !errors.Is(err, engine.ErrInvalidSpec) {
		t.Fatalf("fork ck1 w1 --n 2: %v (%s), want ErrInvalidSpec", err, out)
	}
	if _, err := os.Stat(home); !os.IsNotExist(err) {
		t.Errorf("a refused request touched the state directory: %v", err)
	}
}
