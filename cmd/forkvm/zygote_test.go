package main

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/engine"
)

// TestZygoteShimDefault: the daemon forks its QEMUs from the shim beside the binary
// where it is there, unless --merge-pages, --zygote=false (which also clears
// $FORKVM_ZYGOTE_SHIM) or $FORKVM_ZYGOTE_SHIM says otherwise; one-shot commands do
// only with --zygote.
func TestZygoteShimDefault(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the zygote is Linux only")
	}
	beside := engine.ZygoteShimBeside()
	shimOf := func(t *testing.T, daemon bool, args ...string) string {
		global := newApp().Flags // a flag keeps what a run set it to
		flag := func(name string) cli.Flag {
			i := slices.IndexFunc(global, func(f cli.Flag) bool { return f.Names()[0] == name })
			return global[i]
		}
		var got string
		cmd := &cli.Command{Name: "forkvm", Flags: []cli.Flag{flag("zygote"), flag("merge-pages")},
			Action: func(_ context.Context, cmd *cli.Command) error { got = zygoteShim(cmd, daemon); return nil }}
		if err := cmd.Run(context.Background(), append([]string{"forkvm"}, args...)); err != nil {
			t.Fatal(err)
		}
		return got
	}
	cases := []struct {
		name   string
		shim   bool // a shim beside the binary
		env    string
		daemon bool
		args   []string
		want   string
	}{
		{name: "daemon without a shim", daemon: true, want: ""},
		{name: "daemon", shim: true, daemon: true, want: beside},
		{name: "daemon merging", shim: true, daemon: true, args: []string{"--merge-pages"}, want: ""},
		{name: "daemon told not to", shim: true, daemon: true, args: []string{"--zygote=false"}, want: ""},
		{name: "daemon with the environment's", shim: true, env: "/elsewhere.so", daemon: true, want: ""},
		{name: "one-shot", shim: true, want: ""},
		{name: "one-shot told to", args: []string{"--zygote"}, want: beside},
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
			if got := shimOf(t, tc.daemon, tc.args...); got != tc.want {
				t.Errorf("zygoteShim(%q, daemon %v) = %q, want %q", tc.args, tc.daemon, got, tc.want)
			}
			if env := os.Getenv("FORKVM_ZYGOTE_SHIM"); env != tc.env && !slices.Contains(tc.args, "--zygote=false") {
				t.Errorf("$FORKVM_ZYGOTE_SHIM changed to %q", env)
			}
		})
	}
	t.Run("told not to clears the environment's", func(t *testing.T) {
		t.Setenv("FORKVM_ZYGOTE_SHIM", "/elsewhere.so")
		if got := shimOf(t, true, "--zygote=false"); got != "" {
			t.Errorf("zygoteShim = %q", got)
		}
		if env, ok := os.LookupEnv("FORKVM_ZYGOTE_SHIM"); ok {
			t.Errorf("$FORKVM_ZYGOTE_SHIM still %q", env)
		}
	})
	if got := filepath.Base(beside); got != engine.ZygoteShimName {
		t.Errorf("shim beside the binary is named %q", got)
	}
}
