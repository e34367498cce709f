package tests

import (
	"context"
	"errors"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
)

// debianImageName is the Debian root image (minbase + python3) the image tests boot.
const debianImageName = "deb-py3"

// createDebianImage creates the Debian test image under namesDir, logging to log.
func createDebianImage(ctx context.Context, namesDir string, log *strings.Builder) error {
	_, err := guest.CreateImage(ctx, &guest.ImageConfig{
		Name: debianImageName, CacheDir: cacheDir, NamesDir: namesDir, Log: log,
		Debian: &guest.DebianSource{Include: []string{"python3"}}, AgentBinary: filepath.Join(binDir, "forkvm-agent"),
	})
	return err
}

// debianPrebuild is the build of the Debian test image's recipe that TestMain starts in
// the background when the run includes a test that boots it: mmdebstrap (most of a
// minute per agent build, much of it downloading and unpacking) then overlaps the tests
// that run first instead of adding to the run. debianImage waits for it and fails on
// its error, so a broken build still fails those tests.
var debianPrebuild struct {
	done     chan struct{} // closed when the build ended; nil when none was started
	took     time.Duration
	log      strings.Builder
	err      error
	namesDir string // the build's own names directory (removed after the run)
}

// debianTests are the tests that boot the Debian image.
var debianTests = []string{"TestNetRootImage", "TestRootImage"}

// startDebianPrebuild starts the background build when the -run pattern selects one of
// debianTests and mmdebstrap is installed (without it, debianImage reports the error).
func startDebianPrebuild() {
	if _, err := exec.LookPath("mmdebstrap"); err != nil || !runSelectsAny(debianTests) {
		return
	}
	dir, err := os.MkdirTemp("", "fvt-deb-names-")
	if err != nil {
		return
	}
	p := &debianPrebuild
	p.namesDir, p.done = dir, make(chan struct{})
	go func() {
		defer close(p.done)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		t0 := time.Now()
		p.err = createDebianImage(ctx, dir, &p.log)
		p.took = time.Since(t0)
	}()
}

// finishDebianPrebuild waits for the background build (a run whose image tests failed
// early must not leave mmdebstrap running) and removes its names directory, as a test's
// teardown removes the names of its state directory: the built disk stays cached for
// its recipe.
func finishDebianPrebuild() {
	if p := &debianPrebuild; p.done != nil {
		<-p.done
		os.RemoveAll(p.namesDir)
	}
}

// runSelectsAny reports whether go test's -run pattern (its top-level part) may select
// one of the tests named; an empty or unparsable pattern selects them all.
func runSelectsAny(names []string) bool {
	f := flag.Lookup("test.run")
	if f == nil || f.Value.String() == "" {
		return true
	}
	re, err := regexp.Compile(strings.SplitN(f.Value.String(), "/", 2)[0])
	if err != nil {
		return true
	}
	return slices.ContainsFunc(names, re.MatchString)
}

// debianImage names a Debian root image with python3 in env's state directory
// (image names are per state directory). The recipe cache builds it once per agent
// build (mmdebstrap + mkfs: tens of seconds; TestMain starts that build in the
// background) and then only names the cached disk.
func debianImage(t *testing.T, env *testEnv) string {
	t.Helper()
	if _, err := exec.LookPath("mmdebstrap"); err != nil {
		t.Fatalf("mmdebstrap is missing (make setup installs it): %v", err)
	}
	const name = debianImageName
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if p := &debianPrebuild; p.done != nil {
		t0 := time.Now()
		select {
		case <-p.done:
		case <-ctx.Done():
			t.Fatalf("the background build of image %s did not end: %v", name, ctx.Err())
		}
		if p.err != nil {
			t.Fatalf("create image %s (built in the background): %v\n%s", name, p.err, p.log.String())
		}
		t.Logf("image %s built in the background in %v (waited %v): %s", name, p.took.Round(time.Millisecond),
			time.Since(t0).Round(time.Millisecond), strings.TrimSpace(p.log.String()))
	}
	t0 := time.Now()
	var log strings.Builder
	if err := createDebianImage(ctx, engine.ImageNamesDir(env.Home), &log); err != nil {
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
	// A second VM of the image comes from the boot cache (deb's boot, or the same
	// shape's before it), with its own overlay: none of deb's writes.
	w2, err := e.Create(ctx, engine.Spec{Name: "deb2", CPUs: 1, MemoryMiB: 512, Forkable: true, Image: img})
	if err != nil {
		t.Fatalf("second create from image: %v", err)
	}
	if !w2.Info().BootCached {
		t.Error("deb2 was booted: the boot cache holds no boot of the image")
	}
	if got := mustRun(t, w2, ". /etc/os-release && echo $ID; hostname; cat /root/state 2>&1; echo mine > /root/x; sync"); !strings.HasPrefix(got, "debian\ndeb2\ncat:") {
		t.Errorf("deb2 sees %q", got)
	}
	if got := mustRun(t, w, "ls /root/x 2>&1 || true"); !strings.Contains(got, "No such file") {
		t.Errorf("deb sees deb2's file: %q", got)
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
