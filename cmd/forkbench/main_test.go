package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/forkvm/forkvm/engine"
	"github.com/urfave/cli/v3"
)

// helpDefault is the "(default: X)" --help prints for flag of a subcommand.
func helpDefault(t *testing.T, sub, flag string) string {
	t.Helper()
	app := newApp()
	var out bytes.Buffer
	app.Writer, app.ErrWriter = &out, &out
	if err := app.Run(context.Background(), []string{"forkbench", sub, "--help"}); err != nil {
		t.Fatalf("%s --help: %v", sub, err)
	}
	m := regexp.MustCompile(`(?m)^\s*--` + flag + `\b.*\(default: ([^)]*)\)\s*$`).FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("%s --help shows no default for --%s:\n%s", sub, flag, out.String())
	}
	return m[1]
}

// TestOvercommitDefault checks that every subcommand, given no --overcommit, runs with the
// default its --help prints.
func TestOvercommitDefault(t *testing.T) {
	for _, sub := range newApp().Commands {
		if !slices.ContainsFunc(sub.Flags, func(f cli.Flag) bool { return f.Names()[0] == "overcommit" }) {
			continue // compare measures nothing
		}
		app := newApp()
		var got float64
		app.Command(sub.Name).Action = func(_ context.Context, cmd *cli.Command) error {
			got = cmd.Float("overcommit")
			return nil
		}
		if err := app.Run(context.Background(), []string{"forkbench", sub.Name}); err != nil {
			t.Fatalf("%s: %v", sub.Name, err)
		}
		help := helpDefault(t, sub.Name, "overcommit")
		if want, err := strconv.ParseFloat(help, 64); err != nil || got != want {
			t.Errorf("%s: --overcommit resolves to %v, --help says %q", sub.Name, got, help)
		}
	}
	if d := helpDefault(t, "fanout", "overcommit"); d != "12" {
		t.Errorf("fanout --help: --overcommit default %s, want 12", d)
	}
	// fanout's own Action must not change it either: run it up to its first check.
	app := newApp()
	var out bytes.Buffer
	app.Writer, app.ErrWriter = &out, &out
	if err := app.Run(context.Background(), []string{"forkbench", "fanout", "--waves", "x"}); err == nil || !strings.Contains(err.Error(), "--waves") {
		t.Fatalf("fanout --waves x: %v", err)
	}
	if got := app.Command("fanout").Float("overcommit"); got != 12 {
		t.Errorf("fanout's Action changed --overcommit to %v", got)
	}
}

// TestFleetFlagsRefused: bad fleet bench flags are refused before any daemon starts.
func TestFleetFlagsRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--nodes", "1"},
		{"--nodes", "6"},
		{"--n", "2"}, // fewer forks than nodes
		{"--node-vcpus", "-1"},
		{"--max-jobs", "-1"},
		{"--node-vcpus", "10"}, // 3 x 10 < 48
		{"--daemon-overcommit", "0"},
		{"--target-overhead-ms", "-1"},
		{"--trace", "x.json"},
		{"--hold"},
		{"--counters"},
		{"--forkvm", "/nonexistent/forkvm"},
	} {
		app := newApp()
		var out bytes.Buffer
		app.Writer, app.ErrWriter = &out, &out
		err := app.Run(context.Background(), append([]string{"forkbench", "fleet"}, args...))
		if !errors.Is(err, bench.ErrFleetArgs) {
			t.Errorf("fleet %v: %v, want a refusal (errFleetArgs)", args, err)
		}
	}
}

// TestExecLoadFlags checks exec-load's world defaults and that bad flags are refused
// before anything boots.
func TestExecLoadFlags(t *testing.T) {
	for flag, want := range map[string]string{"cpus": "1", "memory-mb": "256", "dirty-mb": "32", "disk-mb": "0",
		"clients": "32", "execs": "100", "forks": "8", "target": "1.2"} {
		if got := helpDefault(t, "exec-load", flag); got != want {
			t.Errorf("exec-load --%s default %s, want %s", flag, got, want)
		}
	}
	for _, args := range [][]string{
		{"--forks", "9", "--clients", "8"},
		{"--clients", "0"},
		{"--execs", "0"},
		{"--rounds", "0"},
		{"--target", "-1"},
		{"--cmd", "true", "--", "echo", "x"},
		{"--cmd", " "},
		{"--daemon-binary", "/nonexistent/forkvm"},
	} {
		app := newApp()
		var out bytes.Buffer
		app.Writer, app.ErrWriter = &out, &out
		err := app.Run(context.Background(), append([]string{"forkbench", "exec-load"}, args...))
		if err == nil || !strings.Contains(err.Error(), "exec-load") {
			t.Errorf("exec-load %v: %v, want a refusal", args, err)
		}
	}
}

// TestPopulationFlagsRefused: population refuses impossible counts before it starts.
func TestPopulationFlagsRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--sandboxes", "0"},
		{"--running", "-1"},
		{"--sample", "-1"},
	} {
		app := newApp()
		var out bytes.Buffer
		app.Writer, app.ErrWriter = &out, &out
		err := app.Run(context.Background(), append([]string{"forkbench", "population"}, args...))
		if !errors.Is(err, bench.ErrPopulationArgs) {
			t.Errorf("population %v: %v, want a refusal (ErrPopulationArgs)", args, err)
		}
	}
}

// TestZygoteDefault: a bench forks its QEMUs from the shim beside forkbench where it is
// there, as forkvm serve does, unless --merge-pages, --zygote=false (which also clears
// $FORKVM_ZYGOTE_SHIM) or $FORKVM_ZYGOTE_SHIM (the engine's then); without the shim it
// executes them, and --zygote asks for it regardless (the engine then says it is
// missing).
func TestZygoteDefault(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the zygote is Linux only")
	}
	beside := engine.ZygoteShimBeside()
	cases := []struct {
		name string
		shim bool
		env  string // $FORKVM_ZYGOTE_SHIM
		args []string
		want bool
	}{
		{name: "no shim", want: false},
		{name: "shim", shim: true, want: true},
		{name: "merging", shim: true, args: []string{"--merge-pages"}, want: false},
		{name: "told not to", shim: true, args: []string{"--zygote=false"}, want: false},
		{name: "told to", args: []string{"--zygote"}, want: true},
		{name: "the environment's", shim: true, env: "/elsewhere.so", want: false},
		{name: "told not to, with the environment's", shim: true, env: "/elsewhere.so", args: []string{"--zygote=false"}, want: false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.shim {
				if err := os.WriteFile(beside, nil, 0o644); err != nil {
					t.Skipf("no shim beside the test binary: %v", err)
				}
				t.Cleanup(func() { os.Remove(beside) })
			}
			t.Setenv("FORKVM_ZYGOTE_SHIM", tc.env)
			app := newApp()
			var got bench.Options
			app.Command("fork").Action = func(_ context.Context, cmd *cli.Command) error {
				got = commonOptions(cmd)
				return nil
			}
			if err := app.Run(context.Background(), append([]string{"forkbench", "fork"}, tc.args...)); err != nil {
				t.Fatal(err)
			}
			if got.Zygote != tc.want {
				t.Errorf("forkbench fork %q: Zygote %v, want %v", tc.args, got.Zygote, tc.want)
			}
			// What the engine takes up when Zygote is false.
			if env, told := os.Getenv("FORKVM_ZYGOTE_SHIM"), slices.Contains(tc.args, "--zygote=false"); (told && env != "") || (!told && env != tc.env) {
				t.Errorf("forkbench fork %q: $FORKVM_ZYGOTE_SHIM %q afterwards", tc.args, env)
			}
		})
	}
}

// TestWorldShapeRefused: a world shape the engine refuses, or one it would read as its
// default (--cpus 0, --memory-mb 0: the report would name a shape the world does not
// have), is refused before the engine opens. --dirty-mb -1 is refused after the shape:
// an unrefused shape fails there, and nothing boots.
func TestWorldShapeRefused(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--cpus", "0"}, "cpus must be 1..64, got 0"},
		{[]string{"--cpus", "-2"}, "cpus must be 1..64, got -2"},
		{[]string{"--memory-mb", "0"}, "memory must be 64..262144 MiB, got 0"},
		{[]string{"--disk-mb", "3"}, "disk must be 0 (none) or 8..1048576 MiB"},
	} {
		app := newApp()
		var out bytes.Buffer
		app.Writer, app.ErrWriter = &out, &out
		args := append([]string{"forkbench", "fork", "--out", t.TempDir(), "--dirty-mb", "-1"}, tc.args...)
		err := app.Run(context.Background(), args)
		if !errors.Is(err, engine.ErrInvalidSpec) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("fork %q: %v, want ErrInvalidSpec: %s", tc.args, err, tc.want)
		}
	}
}

// TestNoArguments: a bench that takes no arguments refuses one, where it once ran with
// its defaults (`forkbench fork 10` ran 30 forks). --dirty-mb -1 stops a bench that
// takes the argument before anything boots.
func TestNoArguments(t *testing.T) {
	n := 0
	for _, sub := range newApp().Commands {
		if sub.ArgsUsage != "" {
			continue // compare's files, exec-load's guest argv
		}
		n++
		app := newApp()
		var out bytes.Buffer
		app.Writer, app.ErrWriter = &out, &out
		err := app.Run(context.Background(), []string{"forkbench", sub.Name, "10", "--dirty-mb", "-1", "--out", t.TempDir()})
		want := fmt.Sprintf(`%s: unexpected argument "10"`, sub.Name)
		if err == nil || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("%s 10: %v, want %s", sub.Name, err, want)
		}
	}
	if n < 10 {
		t.Errorf("only %d benches take no arguments", n)
	}
}

// TestUsageErrors: an unknown bench or flag is one error line, without the help text
// urfave/cli prints (and without its exit status 3 for an unknown bench, which is not
// one of forkbench's: 1 for an error, 2 for a bench that ran but was not OK).
func TestUsageErrors(t *testing.T) {
	exiter := cli.OsExiter
	defer func() { cli.OsExiter = exiter }()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"nosuch"}, `unknown bench "nosuch" (forkbench --help lists them)`},
		{[]string{"forkk"}, `unknown bench "forkk"`},
		{[]string{"fanout", "--wavs", "3"}, "fanout: flag provided but not defined: -wavs (forkbench fanout --help lists the flags)"},
		{[]string{"fork", "--n", "abc"}, `fork: invalid value "abc" for flag -n`},
	} {
		exited := -1
		cli.OsExiter = func(code int) { exited = code }
		app := newApp()
		var out bytes.Buffer
		app.Writer, app.ErrWriter = &out, &out
		err := app.Run(context.Background(), append([]string{"forkbench"}, tc.args...))
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) || out.Len() != 0 || exited != -1 {
			t.Errorf("forkbench %q: %v, exit %d, printed %q; want the error %q alone", tc.args, err, exited, out.String(), tc.want)
		}
	}
}
