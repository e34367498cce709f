package bench

import (
	"fmt"
	"strings"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// PythonSettings are python's environment.settings.
type PythonSettings struct {
	N    int `json:"n"`
	Cold int `json:"cold"`
	Warm int `json:"warm"`
	report.RunSettings
}

// pythonModules are what the warm interpreter has imported (and the cold start imports).
const pythonModules = "json, re, collections, datetime, decimal, hashlib, itertools, math, random, statistics, " +
	"subprocess, textwrap, urllib.request, xml.etree.ElementTree, sqlite3, csv, email.message, http.client, " +
	"argparse, pathlib, typing, dataclasses, asyncio, unittest, logging, tempfile, shutil, zipfile"

// warmServer is the world's interpreter: it imports pythonModules, says so, then answers
// each expression written to a FIFO on another FIFO.
const warmServer = `import os
` + "import " + pythonModules + `
for p in ("/run/warm.in", "/run/warm.out"):
    if not os.path.exists(p):
        os.mkfifo(p)
open("/run/warm.ready", "w").close()
while True:
    with open("/run/warm.in") as f:
        expr = f.read().strip()
    try:
        out = repr(eval(expr))
    except Exception as e:
        out = "error: %r" % (e,)
    with open("/run/warm.out", "w") as f:
        f.write(out + "\n")
`

// askWarm is the command that asks the warm interpreter for 6*7.
const askWarm = "echo '6*7' > /run/warm.in && cat /run/warm.out"

// RunPython measures fork → first answer of a world's waiting python3 interpreter n
// times, beside a cold python3 start in each of cold freshly booted VMs (and, with pool,
// forks from a pre-restored pool of pool processes).
func RunPython(r *Env, n, cold, pool int) error {
	ctx := r.ctx
	w, err := bakeWorld(r, "world", "")
	if err != nil {
		return err
	}
	start := "cat > /root/warm.py <<'EOF'\n" + warmServer + "EOF\n" +
		"setsid python3 /root/warm.py </dev/null >/root/warm.log 2>&1 &\n" +
		"i=0; while [ ! -e /run/warm.ready ]; do i=$((i+1)); [ $i -gt 1200 ] && { cat /root/warm.log; exit 1; }; sleep 0.1; done"
	t0 := time.Now()
	if _, err := shell(ctx, w.VM, start, 5*time.Minute); err != nil {
		return fmt.Errorf("warm interpreter: %w", err)
	}
	warmStartMS := report.Ms(time.Since(t0))
	if out, err := shell(ctx, w.VM, askWarm, time.Minute); err != nil || strings.TrimSpace(out) != "42" {
		return fmt.Errorf("warm interpreter answers %q: %v", out, err)
	}
	ck, err := r.e.Checkpoint(ctx, w.Name, "warm-ck", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	r.res.Extra["checkpoint_ms"] = report.Round3(report.Ms(ck.Manifest.Timings.Total))
	warm := forkAndAsk(r, "warm", "py", n, nil)
	var pooled []float64
	if pool > 0 {
		opts := &engine.WarmOptions{Restored: true, WarmUp: []string{"sh", "-c", askWarm}}
		if err := r.e.Warm(ctx, "warm-ck", pool, opts); err != nil {
			return fmt.Errorf("warm pool: %w", err)
		}
		pooled = forkAndAsk(r, "pooled", "pp", n, func() {
			// Each sample is a fork served by a full pool: wait for the refill of the last
			// claim (a fork that finds the pool empty is an ordinary fork).
			for t := time.Now(); time.Since(t) < 2*time.Minute; time.Sleep(50 * time.Millisecond) {
				if size, err := r.e.PoolSize(ctx, "warm-ck"); err != nil || size >= pool {
					break
				}
			}
		})
		if err := r.e.Warm(ctx, "warm-ck", 0, nil); err != nil {
			r.fail("emptying the pool: %v", err)
		}
	}
	var coldMS []float64
	coldCmd := fmt.Sprintf("python3 -c 'import %s; print(6*7)'", pythonModules)
	for i := 0; i < cold; i++ {
		name := fmt.Sprintf("cold%d", i+1)
		s := report.Sample{Group: "cold", Index: i, Name: name}
		vm, err := r.e.Create(ctx, worldSpec(r, name, false))
		if err == nil {
			t := time.Now()
			var out string
			out, err = shell(ctx, vm, coldCmd, 5*time.Minute)
			if err == nil && strings.TrimSpace(out) != "42" {
				err = fmt.Errorf("printed %q", out)
			}
			s.LatencyMS = report.Ms(time.Since(t))
			_ = r.e.Delete(ctx, name)
		}
		if err != nil {
			s.Error = err.Error()
			r.fail("cold start %s: %v", name, err)
		} else {
			s.OK = true
			coldMS = append(coldMS, s.LatencyMS)
		}
		r.addSample(s)
	}
	pw := r.p50Headline("warm_fork_first_answer_p50_ms", warm)
	pc := report.Summarize(coldMS)
	r.res.Extra["warm_interpreter_start_ms"] = report.Round3(warmStartMS)
	r.res.Extra["cold_python_ms"] = roundP(pc)
	ratio := 0.0
	if pw.P50 > 0 {
		ratio = report.Round3(pc.P50 / pw.P50)
	}
	r.res.Extra["cold_over_warm"] = ratio
	poolText := ""
	if pool > 0 {
		pp := report.Summarize(pooled)
		r.res.Extra["pooled_fork_first_answer_ms"] = roundP(pp)
		if pp.P50 > 0 {
			r.res.Extra["cold_over_pooled"] = report.Round3(pc.P50 / pp.P50)
			poolText = fmt.Sprintf(" From a pre-restored pool of %d warmed up by one question: p50 %.0f ms (n=%d), cold / pooled = %.1fx.", pool, pp.P50, len(pooled), pc.P50/pp.P50)
		}
	}
	r.res.Method = fmt.Sprintf("A world booted from image %s (dirtied %d MB, %d MB in $HOME/state.bin) starts python3, which imports %s and then answers expressions written to a FIFO; the world is checkpointed. Warm: %d times, engine.Fork of that checkpoint, then `echo '6*7' > /run/warm.in && cat /run/warm.out` through the agent until it printed 42 (sample = fork start to answer), fork deleted. Pooled (with --warm N > 0): the same %d times with a pre-restored warm pool of N whose warm-up command is that same question (each pooled process has answered once and its QEMU has translated the path; refills run in the background while forks are measured). Cold: %d times, a freshly booted VM of the same image and shape (boot not timed), then `python3 -c 'import <the same modules>; print(6*7)'` (sample = that command's round trip). cold_over_warm = cold p50 / warm p50.",
		r.shape.Image, r.shape.DirtyMB, r.shape.StateMB, pythonModules, n, n, cold)
	r.section("## Warm interpreter\n\nfork → first answer of the world's warm python3: p50 %.0f ms (n=%d); cold python3 start with the same imports in a fresh VM: p50 %.0f ms (n=%d); cold / warm = %.1fx.%s The world's interpreter took %.0f ms to start and import.\n\n",
		pw.P50, len(warm), pc.P50, len(coldMS), ratio, poolText, warmStartMS)
	return nil
}

// forkAndAsk forks the warm checkpoint n times and asks each fork's interpreter once;
// it returns the fork start → answer times of the forks that answered 42. before, if
// set, runs before each fork (not timed).
func forkAndAsk(r *Env, group, prefix string, n int, before func()) []float64 {
	ctx := r.ctx
	var out []float64
	for i := 0; i < n; i++ {
		if before != nil {
			before()
		}
		name := fmt.Sprintf("%s%d", prefix, i+1)
		s := report.Sample{Group: group, Index: i, Name: name}
		t := time.Now()
		vm, err := r.e.Fork(ctx, "warm-ck", &engine.ForkOptions{Name: name})
		if err == nil {
			var ans string
			ans, err = shell(ctx, vm, askWarm, time.Minute)
			if err == nil && strings.TrimSpace(ans) != "42" {
				err = fmt.Errorf("answered %q", ans)
			}
			s.LatencyMS = report.Ms(time.Since(t))
			_ = r.e.Delete(ctx, name)
		}
		if err != nil {
			s.Error = err.Error()
			r.fail("%s fork %s: %v", group, name, err)
		} else {
			s.OK = true
			out = append(out, s.LatencyMS)
		}
		r.addSample(s)
	}
	return out
}
