package tests

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// TestForkBomb: a fork bomb run by one command in a fork (b(){ b|b& }; b) does not lock
// out the agent: the next commands, each with a 5 s timeout, start and answer (they
// were refused with "resource temporarily unavailable" for about a minute, and one
// took 38.7 s), and the bomb stays within its command's cgroup's pids.max.
func TestForkBomb(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makeWorld(t, e, "w", 256, 0)
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	g, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "g1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, errs, code := run(t, g, "(b(){ b|b& }; b) >/dev/null 2>&1 </dev/null"); code != 0 {
		t.Fatalf("starting the bomb: exit %d: %s", code, errs)
	}
	// The bomb grows until its cgroup's bound holds it: wait for that (a condition, no
	// bare sleep), asking with a timeout as a user would.
	var bombCg string
	for i := 0; ; i++ {
		var out strings.Builder
		t0 := time.Now()
		code, err := g.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c",
			"for d in /sys/fs/cgroup/forkvm-exec/e*; do echo $d $(cat $d/pids.current) $(cat $d/pids.max) $(cat $d/pids.events | grep max); done"},
			Stdout: &out, Timeout: 5 * time.Second})
		took := time.Since(t0)
		if err != nil || code != 0 {
			t.Fatalf("exec %d during the bomb (after %v): exit %d, %v", i, took.Round(time.Millisecond), code, err)
		}
		t.Logf("exec %d during the bomb: %v: %s", i, took.Round(time.Millisecond), strings.TrimSpace(out.String()))
		for _, l := range strings.Split(out.String(), "\n") {
			f := strings.Fields(l)
			if len(f) == 5 && f[3] == "max" {
				if n, _ := strconv.Atoi(f[4]); n > 0 {
					bombCg = f[0] // its bound refused a fork: the bomb is at its cap
				}
				cur, _ := strconv.Atoi(f[1])
				if lim, err := strconv.Atoi(f[2]); err == nil && cur > lim {
					t.Errorf("%s holds %d tasks, over its pids.max %d", f[0], cur, lim)
				}
			}
		}
		if bombCg != "" && i >= 2 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the bomb never reached its bound")
		}
	}
	// Commands still start, and a command that times out is bounded from the host.
	code, err := g.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"true"}, Timeout: 5 * time.Second})
	if err != nil || code != 0 {
		t.Errorf("true during the bomb: exit %d, %v", code, err)
	}
	code, err = g.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sleep", "30"}, Timeout: time.Second})
	if code != vsockd.ExitCodeTimeout && !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("sleep 30 with a 1 s timeout during the bomb: exit %d, %v", code, err)
	}
	mustRun(t, g, "echo 1 > "+bombCg+"/cgroup.kill")
}
