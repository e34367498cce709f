package tests

import (
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
)

// debianImage names a Debian root image with python3 in env's state directory
// (image names are per state directory). The recipe cache builds it once per agent
// build (mmdebstrap + mkfs: tens of seconds) and then only names the cached disk.
func debianImage(t *testing.T, env *testEnv) string {
	t.Helper()
	if _, err := exec.LookPath("mmdebstrap"); err != nil {
		t.Fatalf("mmdebstrap is missing (make setup installs it): %v", err)
	}
	const name = "deb-py3"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	t0 := time.Now()
	var log strings.Builder
	_, err := guest.CreateImage(ctx, &guest.ImageConfig{
		Name: name, CacheDir: cacheDir, NamesDir: engine.ImageNamesDir(env.Home), Log: &log,
		Debian: &guest.DebianSource{Include: []string{"python3"}}, AgentBinary: filepath.Join(binDir, "forkvm-agent"),
	})
	if err != nil {
		t.Fatalf("create image %s: %v\n%s", name, err, log.String())
	}
	t.Logf("image %s in %v: %s", name, time.Since(t0).Round(time.Millisecond), strings.TrimSpace(log.String()))
	return name
}

// TestRootImage boots a Debian root image through the engine, runs python3 in it, and
// checks that a checkpoint and forks of it keep the real userland, its state and their
// isolation, with nothing left behind.
func TestRootImage(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	img := debianImage(t, env)
	e := env.E
	ctx := ctxT(t, 5*time.Minute)

	w, err := e.Create(ctx, engine.Spec{Name: "deb", CPUs: 1, MemoryMiB: 512, Forkable: true, Image: img})
	if err != nil {
		t.Fatalf("create from image: %v", err)
	}
	t.Logf("boot from image: %v", w.Info().Timings.Total.Round(time.Millisecond))
	if got := mustRun(t, w, ". /etc/os-release && echo $ID"); got != "debian" {
		t.Fatalf("os-release ID = %q, want debian", got)
	}
	// The image's agent is PID 1 too: signals from guest root do not kill it.
	mustRun(t, w, "kill -TERM 1; kill -QUIT 1; kill -SEGV 1; kill -HUP 1")
	if got := mustRun(t, w, "echo alive"); got != "alive" {
		t.Fatalf("after signals to PID 1: %q", got)
	}
	if got := mustRun(t, w, "python3 -c 'import json,sys; print(json.dumps({\"v\": sys.version_info[0]}))'"); got != `{"v": 3}` {
		t.Fatalf("python3 = %q", got)
	}
	mustRun(t, w, "echo world-state > /root/state && python3 -c 'open(\"/dev/shm/mem\",\"w\").write(\"in-memory\")' && sync")

	if _, err := e.Checkpoint(ctx, "deb", "debck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	mustRun(t, w, "echo after > /root/state")
	var forks []*engine.VM
	for _, n := range []string{"df1", "df2"} {
		f, err := e.Fork(ctx, "debck", &engine.ForkOptions{Name: n})
		if err != nil {
			t.Fatalf("fork %s: %v", n, err)
		}
		forks = append(forks, f)
		if got := mustRun(t, f, "cat /root/state /dev/shm/mem; echo; python3 -c 'print(6*7)'"); got != "world-state\nin-memory\n42" {
			t.Fatalf("%s sees %q", n, got)
		}
	}
	mustRun(t, forks[0], "echo mine > /root/state")
	if got := mustRun(t, forks[1], "cat /root/state"); got != "world-state" {
		t.Errorf("sibling sees %q after df1 wrote its disk", got)
	}
	if got := mustRun(t, w, "cat /root/state"); got != "after" {
		t.Errorf("world sees %q", got)
	}
	// The image's disk is never written: the VM's writes land in its overlay.
	if files := dirNames(filepath.Join(env.Home, "vms", "deb")); !strings.Contains(strings.Join(files, " "), "root.qcow2") {
		t.Errorf("deb has no root overlay: %v", files)
	}
	deleteAll(t, env)
}

// TestRootImageBadInput: an unknown or invalid image is refused before anything starts.
func TestRootImageBadInput(t *testing.T) {
	env := newRobustEnv(t, nil)
	ctx := ctxT(t, time.Minute)
	_, err := env.E.Create(ctx, engine.Spec{Name: "x", CPUs: 1, MemoryMiB: 256, Image: "no-such-image"})
	if !errors.Is(err, engine.ErrImageNotFound) || !strings.Contains(err.Error(), "forkvm images") {
		t.Errorf("unknown image: %v, want ErrImageNotFound pointing to forkvm images", err)
	}
	_, err = env.E.Create(ctx, engine.Spec{Name: "x", CPUs: 1, MemoryMiB: 256, Image: "../etc"})
	if !errors.Is(err, engine.ErrInvalidSpec) {
		t.Errorf("invalid image name: %v, want ErrInvalidSpec", err)
	}
	checkState(t, env, expectState{})
}
