package qemu

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"

	"github.com/forkvm/forkvm/api"
)

// Errors of binary probing: the API's own sentinels (the engine re-exports them, the
// daemon's clients match them), so errors.Is holds on every side of the wall.
var (
	// ErrMissing reports that no usable QEMU binary was found.
	ErrMissing = api.ErrQEMUMissing
	// ErrTooOld reports a QEMU older than MinMajor.
	ErrTooOld = api.ErrQEMUTooOld
)

// MinMajor is the oldest QEMU major version forkvm drives: the verbs and properties
// it relies on (blockdev-set-active, x-ignore-shared file migration) are QEMU 10's.
const MinMajor = 10

// SystemBinary resolves the qemu-system binary for this host's architecture: the
// configured path when given (it must exist), else the one in PATH; else ErrMissing.
func SystemBinary(configured string) (string, error) {
	if configured != "" {
		if _, err := os.Stat(configured); err != nil {
			return "", fmt.Errorf("%w: %s: %v", ErrMissing, configured, err)
		}
		return configured, nil
	}
	name := "qemu-system-x86_64"
	if runtime.GOARCH == "arm64" {
		name = "qemu-system-aarch64"
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("%w: %s is not in PATH", ErrMissing, name)
	}
	return p, nil
}

// ImgBinary resolves qemu-img: the configured path when given, else the one in PATH;
// else ErrMissing.
func ImgBinary(configured string) (string, error) {
	if configured != "" {
		return configured, nil
	}
	p, err := exec.LookPath("qemu-img")
	if err != nil {
		return "", fmt.Errorf("%w: qemu-img is not in PATH", ErrMissing)
	}
	return p, nil
}

var versionRE = regexp.MustCompile(`version (\d+)\.(\d+)\.(\d+)`)

// Version runs `bin --version` and returns QEMU's version ("10.0.2"): ErrMissing when
// it cannot run or say, ErrTooOld below MinMajor.
func Version(ctx context.Context, bin string) (string, error) {
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	if err != nil && ctx.Err() != nil {
		// Killed (or never started) because ctx ended: the caller's cause, not a
		// missing QEMU (a fork cancelled by a forced checkpoint delete said "qemu not
		// found").
		return "", interrupted(ctx, bin+" --version")
	}
	if err != nil {
		return "", fmt.Errorf("%w: %s --version: %v", ErrMissing, bin, err)
	}
	m := versionRE.FindStringSubmatch(string(out))
	if m == nil {
		return "", fmt.Errorf("%w: cannot parse %q", ErrMissing, out)
	}
	if major, _ := strconv.Atoi(m[1]); major < MinMajor {
		return "", fmt.Errorf("%w: %s is %s.%s.%s", ErrTooOld, bin, m[1], m[2], m[3])
	}
	return m[1] + "." + m[2] + "." + m[3], nil
}

// interrupted is the error of work that ctx ended: it wraps ctx.Err() and, when ctx was
// cancelled with a cause of its own (context.WithCancelCause), that cause too.
func interrupted(ctx context.Context, what string) error {
	if cause := context.Cause(ctx); cause != nil && cause != ctx.Err() {
		return fmt.Errorf("%s interrupted: %w: %w", what, cause, ctx.Err())
	}
	return fmt.Errorf("%s interrupted: %w", what, ctx.Err())
}
