// Package tests holds integration tests that boot real QEMU VMs (TCG here, KVM where
// usable) from forkvm's own guest image.
package tests

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
)

// Paths prepared once by TestMain.
var (
	repoRoot  string
	binDir    string // forkvm CLI and agent built for this run
	cacheDir  string // guest image cache (shared with `make setup`)
	imageInfo *guest.Image
)

func TestMain(m *testing.M) {
	code, err := setup()
	if err != nil {
		fmt.Fprintln(os.Stderr, "tests: setup:", err)
		os.Exit(1)
	}
	if code == 0 {
		flag.Parse()
		startDebianPrebuild()
		code = m.Run()
		finishDebianPrebuild()
	}
	os.RemoveAll(binDir)
	os.Exit(code)
}

// setup builds the agent and CLI and makes sure the guest image exists (building it into
// the shared cache when `make setup` has not).
func setup() (int, error) {
	_, file, _, _ := runtime.Caller(0)
	repoRoot = filepath.Dir(filepath.Dir(file))
	var err error
	binDir, err = os.MkdirTemp("", "forkvm-bin-")
	if err != nil {
		return 1, err
	}
	build := func(out, pkg string, flags []string, env ...string) error {
		cmd := exec.Command("go", append(append([]string{"build"}, flags...), "-o", filepath.Join(binDir, out), pkg)...)
		cmd.Dir = repoRoot
		cmd.Env = append(os.Environ(), env...)
		if b, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %v\n%s", pkg, err, b)
		}
		return nil
	}
	// The agent is built as `make build` and the guest package's tests build it, byte
	// for byte: the guest image and the Debian test image are keyed by the agent's
	// digest, so the images `make setup` and those tests made serve this run too (a
	// Debian image is most of a minute of CPU to build).
	if err := build("forkvm-agent", "./cmd/forkvm-agent", []string{"-trimpath", "-buildvcs=false", "-ldflags=-s -w"}, "CGO_ENABLED=0", "GOOS=linux"); err != nil {
		return 1, err
	}
	if err := build("forkvm", "./cmd/forkvm", nil); err != nil {
		return 1, err
	}
	// The zygote's shim beside forkvm, as make builds it: a daemon forks its QEMUs from
	// a zygote where the shim is there (cmd/forkvm), so the tests' daemons do too.
	// Without a C compiler (make setup installs gcc) they execute them.
	if cc, err := exec.LookPath("cc"); err == nil {
		cmd := exec.Command(cc, "-O2", "-shared", "-fPIC", "-o", filepath.Join(binDir, engine.ZygoteShimName), "engine/internal/qemu/zygote/zygote.c", "-ldl")
		cmd.Dir = repoRoot
		if b, err := cmd.CombinedOutput(); err != nil {
			return 1, fmt.Errorf("build the zygote shim: %v\n%s", err, b)
		}
	}
	cacheDir = os.Getenv("FORKVM_CACHE")
	if cacheDir == "" {
		cacheDir = guest.DefaultCacheDir()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	imageInfo, err = guest.Build(ctx, &guest.Config{CacheDir: cacheDir, AgentBinary: filepath.Join(binDir, "forkvm-agent")})
	if err != nil {
		return 1, err
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		return 1, fmt.Errorf("qemu-system-x86_64 not found: run `make setup`")
	}
	return 0, nil
}
