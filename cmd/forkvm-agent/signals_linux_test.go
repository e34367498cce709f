//go:build linux

package main

import (
	"bytes"
	"errors"
	"fmt"
	"log"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

const signalsChildEnv = "FORKVM_AGENT_SIGNALS_CHILD"

// TestMain lets TestSurviveSignals run this test binary as the process that is sent
// the signals (a test cannot survive them in its own process without the fix).
func TestMain(m *testing.M) {
	if os.Getenv(signalsChildEnv) != "" {
		signalsChild()
		return
	}
	os.Exit(m.Run())
}

// signalsChild installs the agent's signal handling, sends itself every signal a guest
// root would use to kill PID 1, and reports that it survived and that a command it
// runs still dies of SIGTERM (the handled disposition is not inherited).
func signalsChild() {
	var logs bytes.Buffer
	surviveSignals(log.New(&logs, "", 0))
	for _, s := range survivableSignals {
		syscall.Kill(os.Getpid(), s.(syscall.Signal))
		time.Sleep(5 * time.Millisecond)
	}
	err := exec.Command("sh", "-c", "kill -TERM $$; sleep 5").Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGTERM {
			fmt.Println("child died of SIGTERM")
		}
	}
	time.Sleep(50 * time.Millisecond)
	fmt.Println("survived")
	fmt.Print(logs.String())
}

func TestSurviveSignals(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), signalsChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the process died: %v\n%s", err, out)
	}
	s := string(out)
	for _, want := range []string{"survived", "child died of SIGTERM", "PID 1 ignores terminated", "PID 1 ignores segmentation fault", "PID 1 ignores quit"} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q:\n%s", want, s)
		}
	}
}
