package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// TestUsageErrors: a command line forkvm cannot parse gets one line on stderr, the flag
// as it was typed, the nearest flag or command when one is near, no help text, and exit
// status 2.
func TestUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"create", "w1", "--cpu", "2"}, "forkvm create: unknown flag --cpu; did you mean --cpus?"},
		{[]string{"create", "-cpu", "2", "w1"}, "forkvm create: unknown flag -cpu; did you mean --cpus?"},
		{[]string{"create", "--cpu=2", "w1"}, "forkvm create: unknown flag --cpu; did you mean --cpus?"},
		{[]string{"create", "w1", "--memroy-mb", "512"}, "forkvm create: unknown flag --memroy-mb; did you mean --memory-mb?"},
		{[]string{"--hom", "x", "ls"}, "forkvm: unknown flag --hom; did you mean --home?"},
		{[]string{"ls", "--verbos"}, "forkvm ls: unknown flag --verbos; did you mean --verbose?"}, // a global flag
		{[]string{"fork", "ck", "--n", "2", "--prefx", "g"}, "forkvm fork: unknown flag --prefx; did you mean --prefix?"},
		{[]string{"ls", "--zzzz"}, "forkvm ls: unknown flag --zzzz (forkvm ls --help lists its flags)"},
		{[]string{"checkpoint", "rm", "--pin", "ck"}, "forkvm checkpoint rm: unknown flag --pin"},
		{[]string{"create", "--cpus", "abc", "w"}, `forkvm create: invalid value "abc" for --cpus: invalid syntax`},
		{[]string{"frob"}, `forkvm: unknown command "frob"; did you mean "fork"?`},
		{[]string{"xyzzy"}, `forkvm: unknown command "xyzzy" (forkvm --help lists them)`},
		{[]string{"chekpoints"}, `forkvm: unknown command "chekpoints"; did you mean "checkpoints"?`},
		{[]string{"image", "crate", "x"}, `forkvm image: unknown command "crate"; did you mean "create"?`},
		{[]string{"help", "frob"}, `forkvm: unknown command "frob"; did you mean "fork"?`},
		{[]string{"create"}, "forkvm: usage: forkvm create NAME [flags]"},
		{[]string{"profile", "faults"}, "forkvm: usage: forkvm profile faults NAME... [--duration 10s]"},
		{[]string{"fork", "x", "--n", "0"}, "forkvm fork: --n must be at least 1, got 0"},
		{[]string{"fork", "x", "--n", "-1"}, "forkvm fork: --n must be at least 1, got -1"},
		{[]string{"fork", "x", "--fleet", "--n", "0"}, "forkvm fork: --n must be at least 1, got 0"},
		{[]string{"cp", "a", "b"}, "forkvm cp: exactly one of SRC and DST must be VM:/path"},
		{[]string{"cp", "a:/x", "b:/y"}, "forkvm cp: exactly one of SRC and DST must be VM:/path"},
	} {
		var stderr strings.Builder
		code := runMain(context.Background(), append([]string{"forkvm"}, tc.args...), &stderr)
		got := stderr.String()
		if code != exitUsage || !strings.HasPrefix(got, tc.want) || strings.Count(got, "\n") != 1 {
			t.Errorf("forkvm %s: exit %d, printed %q; want exit %d and the one line %q", strings.Join(tc.args, " "), code, got, exitUsage, tc.want)
		}
	}
}

// TestNearest: the suggestion is the nearest name by edit distance when it is near
// enough, a unique completion otherwise, nothing for a word like no name.
func TestNearest(t *testing.T) {
	names := []string{"cpus", "memory-mb", "memory-limit-mb", "forkable", "disk-mb", "net"}
	for _, tc := range []struct{ word, want string }{
		{"cpu", "cpus"}, {"cpsu", "cpus"}, {"memory", ""}, {"memory-l", "memory-limit-mb"},
		{"forkabel", "forkable"}, {"nte", "net"}, {"x", ""}, {"publish", ""},
	} {
		if got := nearest(tc.word, names); got != tc.want {
			t.Errorf("nearest(%q) = %q, want %q", tc.word, got, tc.want)
		}
	}
	for _, tc := range []struct {
		a, b string
		d    int
	}{{"", "abc", 3}, {"cpu", "cpus", 1}, {"cpsu", "cpus", 1}, {"frob", "fork", 2}, {"kitten", "sitting", 3}} {
		if d := editDistance(tc.a, tc.b); d != tc.d {
			t.Errorf("editDistance(%q, %q) = %d, want %d", tc.a, tc.b, d, tc.d)
		}
	}
}

// TestUserMessage: errors are printed without the package names their parts carry, a
// missing VM or checkpoint as what to do, and the printed text is all that changes.
func TestUserMessage(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{fmt.Errorf("%w: vm x", engine.ErrNotFound), `VM "x" not found (forkvm ls lists them)`},
		{fmt.Errorf("%w: checkpoint ck.1", engine.ErrNotFound), `checkpoint "ck.1" not found (forkvm checkpoints lists them)`},
		{fmt.Errorf("%w: no checkpoint or vm named ck1", engine.ErrNotFound), `"ck1" not found: no checkpoint or VM has that name (forkvm checkpoints, forkvm ls)`},
		{fmt.Errorf("exec: %w", api.ErrOutputLimit), "exec: output limit exceeded"},
		{fmt.Errorf("%w: in use by f1", engine.ErrInUse), "checkpoint in use: in use by f1"},
		{fmt.Errorf("%w: /root: permission denied for user nobody", api.ErrWorkdir), "bad working directory: /root: permission denied for user nobody"},
		{errors.New("a plain error: engineer: x"), "a plain error: engineer: x"},
	} {
		if got := userMessage(tc.err); got != tc.want {
			t.Errorf("userMessage(%q) = %q, want %q", tc.err, got, tc.want)
		}
	}
	var stderr strings.Builder
	code := runMain(context.Background(), []string{"forkvm", "--home", t.TempDir(), "rm", "nosuch"}, &stderr)
	if code != 1 || stderr.String() != "forkvm: VM \"nosuch\" not found (forkvm ls lists them)\n" {
		t.Errorf("rm nosuch: exit %d, %q", code, stderr.String())
	}
}

// fakeCheckpoints is an API whose GetCheckpoint answers from a map (ErrNotFound for
// others); nothing else of it is called.
type fakeCheckpoints struct {
	api.API
	cks map[string]api.CheckpointInfo
}

func (f fakeCheckpoints) GetCheckpoint(_ context.Context, name string) (api.CheckpointInfo, error) {
	if c, ok := f.cks[name]; ok {
		return c, nil
	}
	return api.CheckpointInfo{}, fmt.Errorf("%w: checkpoint %s", engine.ErrNotFound, name)
}

// TestPinLine: unpin says when it deleted the checkpoint (its forks were all gone), and
// otherwise what will delete it.
func TestPinLine(t *testing.T) {
	cl := fakeCheckpoints{cks: map[string]api.CheckpointInfo{
		"forked": {Forks: []string{"f1", "f2"}}, "fresh": {},
	}}
	for _, tc := range []struct {
		name string
		pin  bool
		want string
	}{
		{"gone", false, "unpinned checkpoint gone: it had no forks left, so it was deleted"},
		{"forked", false, "unpinned checkpoint forked: deleted with the last of its 2 forks"},
		{"fresh", false, "unpinned checkpoint fresh: never forked"},
		{"forked", true, "pinned checkpoint forked: kept after its last fork is deleted"},
	} {
		if got := pinLine(context.Background(), cl, tc.name, tc.pin); !strings.HasPrefix(got, tc.want) {
			t.Errorf("pin %v %s: %q, want %q", tc.pin, tc.name, got, tc.want)
		}
	}
}

// TestNoArguments: a command that takes no arguments (ls, checkpoints, budget, ...)
// refuses one with a usage error before it opens anything, where it once ignored it
// (`forkvm ls w1` listed every VM); one with subcommands says the word is none of them.
func TestNoArguments(t *testing.T) {
	var paths [][]string
	var walk func(path []string, c *cli.Command)
	walk = func(path []string, c *cli.Command) {
		for _, s := range c.Commands {
			p := append(append([]string{}, path...), s.Name)
			if s.ArgsUsage == "" && s.Name != "help" {
				paths = append(paths, p)
			}
			walk(p, s)
		}
	}
	walk(nil, newApp())
	if len(paths) < 6 {
		t.Fatalf("only %d commands without arguments: %q", len(paths), paths)
	}
	for _, p := range paths {
		home := filepath.Join(t.TempDir(), "home")
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		var stderr strings.Builder
		args := append(append([]string{"forkvm", "--home", home}, p...), "w1")
		code := runMain(ctx, args, &stderr)
		cancel()
		got := stderr.String()
		want := fmt.Sprintf(`forkvm %s: unexpected argument "w1"`, strings.Join(p, " "))
		if len(p) == 1 && (p[0] == "image" || p[0] == "profile" || p[0] == "boot-cache") {
			want = fmt.Sprintf(`forkvm %s: unknown command "w1"`, p[0])
		}
		if code != exitUsage || !strings.HasPrefix(got, want) || strings.Count(got, "\n") != 1 {
			t.Errorf("%q: exit %d, printed %q; want exit %d and the one line %q", args[3:], code, got, exitUsage, want)
		}
		if _, err := os.Stat(home); !os.IsNotExist(err) {
			t.Errorf("%q touched the state directory: %v", args[3:], err)
		}
	}
}

// TestCreateSpecRefusedFirst: create refuses a spec the engine's rules refuse before
// an engine is opened (nothing is left in the state directory), and an explicit
// --cpus 0 or --memory-mb 0 is refused as the engine refuses -1, not read as the
// default (`forkvm create w --cpus 0` booted a VM of 2 vCPUs).
func TestCreateSpecRefusedFirst(t *testing.T) {
	for _, tc := range []struct {
		flags []string
		want  string
	}{
		{[]string{"--cpus", "0"}, "cpus must be 1..64, got 0"},
		{[]string{"--memory-mb", "0"}, "memory must be 64..262144 MiB, got 0"},
		{[]string{"--memory-mb", "-1"}, "memory must be 64..262144 MiB, got -1"},
		{[]string{"--memory-mb", "65"}, "multiple of 2 MiB"},
		{[]string{"--disk-mb", "3"}, "disk must be 0 (none) or 8..1048576 MiB"},
		{[]string{"--publish", "8080:80"}, "publish needs a network"},
	} {
		home := filepath.Join(t.TempDir(), "home")
		// An image that is not there: an unrefused spec fails at it and boots nothing.
		args := append([]string{"--home", home, "create", "w", "--image", "nosuch-image"}, tc.flags...)
		out, err := helpOf(t, args...)
		if !errors.Is(err, engine.ErrInvalidSpec) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("create %q: %v (%s), want ErrInvalidSpec: %s", tc.flags, err, out, tc.want)
		}
		if _, err := os.Stat(home); !os.IsNotExist(err) {
			t.Errorf("create %q touched the state directory: %v", tc.flags, err)
		}
	}
}

// TestProtectIntervalRefusedFirst: an interval given as 0 (which the API reads as its
// default) is refused as the help's "1s to 24h" says, as fork --fleet --protect 0
// was, and every refused interval is refused before an engine is opened.
func TestProtectIntervalRefusedFirst(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"protect", "w1", "--every", "0s"}, "--every: invalid spec: a protection interval is 1s to 24h0m0s, not 0s"},
		{[]string{"protect", "w1", "--every", "25h"}, "--every: invalid spec: a protection interval is 1s to 24h0m0s, not 25h0m0s"},
		{[]string{"fork", "ck", "--protect", "0s"}, "--protect: invalid spec: a protection interval is 1s to 24h0m0s, not 0s"},
		{[]string{"fork", "ck", "--protect", "25h"}, "--protect: invalid spec: a protection interval is 1s to 24h0m0s, not 25h0m0s"},
	} {
		home := filepath.Join(t.TempDir(), "home")
		var stderr strings.Builder
		code := runMain(context.Background(), append([]string{"forkvm", "--home", home}, tc.args...), &stderr)
		if want := "forkvm: " + tc.want + "\n"; code != 1 || stderr.String() != want {
			t.Errorf("%q: exit %d, printed %q; want exit 1 and %q", tc.args, code, stderr.String(), want)
		}
		if _, err := os.Stat(home); !os.IsNotExist(err) {
			t.Errorf("%q touched the state directory: %v", tc.args, err)
		}
	}
}

// TestHelpProseFits: help prose broken into lines in the source (a Description, an
// ArgsUsage's paragraphs) fits helpWidth as printed, so that reflowHelp need not break
// it again: cp's and image create's help alternated long and one-word lines. A line
// laid out in two columns wraps under its second and may be longer.
func TestHelpProseFits(t *testing.T) {
	var walk func(c *cli.Command)
	walk = func(c *cli.Command) {
		for _, l := range strings.Split(c.Description, "\n") {
			if !strings.Contains(l, "  ") && 3+len(l) > helpWidth {
				t.Errorf("%s: a description line of %d columns: %q", c.FullName(), 3+len(l), l)
			}
		}
		for _, l := range strings.Split(c.ArgsUsage, "\n")[1:] {
			if len(l) > helpWidth {
				t.Errorf("%s: a usage line of %d columns: %q", c.FullName(), len(l), l)
			}
		}
		for _, s := range c.Commands {
			walk(s)
		}
	}
	walk(newApp())
}
