package main

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/vsockd"
)

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		bad  bool
	}{
		{"64MiB", 64 << 20, false}, {"64M", 64 << 20, false}, {"1g", 1 << 30, false}, {"512KB", 512 << 10, false},
		{"1000", 1000, false}, {"-1", -1, false}, {"unlimited", -1, false},
		{"0", 0, true}, {"", 0, true}, {"12X", 0, true}, {"M", 0, true},
	}
	for _, tt := range tests {
		got, err := parseSize(tt.in)
		if (err != nil) != tt.bad || (!tt.bad && got != tt.want) {
			t.Errorf("parseSize(%q) = %d, %v; want %d (bad %v)", tt.in, got, err, tt.want, tt.bad)
		}
	}
}

// TestInterruptForwarded: a SIGINT while waiting is sent to the guest command (which
// dies of it) and the result is 130.
func TestInterruptForwarded(t *testing.T) {
	a, b := net.Pipe()
	go (&vsockd.Server{}).ServeConn(context.Background(), b)
	c := vsockd.NewClient(a, nil)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p, err := c.Start(ctx, &vsockd.ExecRequest{Argv: []string{"sleep", "30"}})
	if err != nil {
		t.Fatal(err)
	}
	sigs := make(chan os.Signal, 1)
	sigs <- os.Interrupt
	start := time.Now()
	code, err := waitForwarding(p, sigs)
	if err != nil || code != 130 {
		t.Fatalf("waitForwarding = %d, %v; want 130", code, err)
	}
	if d := time.Since(start); d >= signalGrace {
		t.Fatalf("took %v: the SIGINT was not forwarded (killed after the grace)", d)
	}
	if syscall.Kill(p.Pid, 0) == nil {
		t.Fatalf("guest process %d still alive", p.Pid)
	}
}

// TestExecFlagsRefusedFirst: a negative --timeout (which the daemon refuses and the
// in-process engine read as none) and an -e entry that is not KEY=VALUE (which reached
// the guest as a variable-less entry: `-e FOO` did not pass the host's FOO) are
// refused as invalid before an engine is opened.
func TestExecFlagsRefusedFirst(t *testing.T) {
	for _, tc := range []struct {
		flags []string
		want  string
	}{
		{[]string{"--timeout", "-1s"}, "--timeout: invalid spec: -1s is negative (0 = none)"},
		{[]string{"-e", "FOO"}, `-e: invalid spec: "FOO" is not KEY=VALUE`},
		{[]string{"-e", "A=1", "--env", "=x"}, `-e: invalid spec: "=x" is not KEY=VALUE`},
	} {
		home := filepath.Join(t.TempDir(), "home")
		args := append(append([]string{"--home", home, "exec"}, tc.flags...), "w1", "true")
		out, err := helpOf(t, args...)
		if !errors.Is(err, api.ErrInvalidSpec) || err.Error() != tc.want {
			t.Errorf("exec %q: %v (%s), want %s", tc.flags, err, out, tc.want)
		}
		if _, err := os.Stat(home); !os.IsNotExist(err) {
			t.Errorf("exec %q touched the state directory: %v", tc.flags, err)
		}
	}
}
