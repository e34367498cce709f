package guest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// DefaultSuite is the Debian suite of DebianSource when Suite is empty: the
// host's release (bookworm), whose packages the guest kernel was built with.
const DefaultSuite = "bookworm"

var (
	// Debian policy §5.6.7 package names, with an optional :arch qualifier.
	debPackageRE = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]+(:[a-z0-9-]+)?$`)
	debSuiteRE   = regexp.MustCompile(`^[a-z0-9][a-z0-9.-]*$`)
	// What apt prints for a package it cannot install by name.
	unknownPackageREs = []*regexp.Regexp{
		regexp.MustCompile(`Unable to locate package (\S+)`),
		regexp.MustCompile(`Package '([^']+)' has no installation candidate`),
		regexp.MustCompile(`Couldn't find any package by (?:glob|regex) '([^']+)'`),
	}
)

// checkDebian validates a Debian source before anything runs: package names
// must be Debian package names (so none can pass as an mmdebstrap option),
// the suite a suite name, the mirror an http(s) or file URL.
func checkDebian(d *DebianSource) error {
	if !debSuiteRE.MatchString(d.Suite) {
		return fmt.Errorf("%w: Debian suite %q", ErrInvalidImageConfig, d.Suite)
	}
	for _, p := range d.Include {
		if !debPackageRE.MatchString(p) {
			return fmt.Errorf("%w: %q is not a Debian package name", ErrUnknownPackage, p)
		}
	}
	if m := d.Mirror; m != "" {
		if strings.ContainsAny(m, " \t\n") || !(strings.HasPrefix(m, "http://") || strings.HasPrefix(m, "https://") || strings.HasPrefix(m, "file:/")) {
			return fmt.Errorf("%w: Debian mirror %q (want an http://, https:// or file:/ URL)", ErrInvalidImageConfig, m)
		}
	}
	return nil
}

// findMmdebstrap locates mmdebstrap or returns ErrMmdebstrapMissing.
func findMmdebstrap() (string, error) {
	if p, err := exec.LookPath("mmdebstrap"); err == nil {
		return p, nil
	}
	if st, err := os.Stat("/usr/bin/mmdebstrap"); err == nil && st.Mode().IsRegular() {
		return "/usr/bin/mmdebstrap", nil
	}
	return "", ErrMmdebstrapMissing
}

// buildDebian runs `mmdebstrap --variant=minbase` as root into root (which
// must not exist yet). minbase is the Essential packages plus apt: a
// shell, coreutils, dpkg and apt, no init system (the forkvm agent is PID 1).
// mmdebstrap removes the package lists and apt cache when it is done.
//
// Cancelling ctx sends mmdebstrap SIGTERM, on which it unmounts what it
// mounted in the chroot; it is killed 30 s later if it has not exited.
//
// mmdebstrap creates device nodes in /dev (there is no option to skip them in
// bookworm's 1.3.5): once it has exited and nothing is mounted below root
// any more, the character and block devices directly in root/dev are
// removed — the guest mounts devtmpfs there. A device node anywhere else is
// refused later by summarize.
func buildDebian(ctx context.Context, d *DebianSource, root, tmp string, logw io.Writer) error {
	bin, err := findMmdebstrap()
	if err != nil {
		return err
	}
	args := []string{"--variant=minbase", "--mode=root", "--format=directory"}
	if len(d.Include) > 0 {
		args = append(args, "--include="+strings.Join(d.Include, ","))
	}
	args = append(args, d.Suite, root)
	if d.Mirror != "" {
		args = append(args, d.Mirror)
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	// SOURCE_DATE_EPOCH: mmdebstrap's reproducible mode (recipe.go).
	cmd.Env = append(os.Environ(), "LC_ALL=C", "TMPDIR="+tmp, "SOURCE_DATE_EPOCH="+strconv.Itoa(debianSourceDateEpoch))
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	out := &tailBuffer{max: 64 << 10}
	w := io.Writer(out)
	if logw != nil {
		w = io.MultiWriter(out, logw)
	}
	cmd.Stdout, cmd.Stderr = w, w
	runErr := cmd.Run()
	if merr := checkNoMounts(root); merr != nil {
		return fmt.Errorf("%w: %v", ErrDebianBuild, merr)
	}
	if runErr != nil {
		if errors.Is(runErr, exec.ErrNotFound) || errors.Is(runErr, fs.ErrNotExist) {
			return ErrMmdebstrapMissing
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%w: %w", ErrDebianBuild, ctx.Err())
		}
		if pkgs := unknownPackages(out.String()); len(pkgs) > 0 {
			return fmt.Errorf("%w: %s (suite %s)", ErrUnknownPackage, strings.Join(pkgs, ", "), d.Suite)
		}
		return fmt.Errorf("%w: mmdebstrap %s: %v: %s", ErrDebianBuild, strings.Join(args, " "), runErr, lastLines(out.String(), 15))
	}
	if err := removeDevNodes(filepath.Join(root, "dev")); err != nil {
		return err
	}
	return scrubHostFiles(root)
}

// scrubHostFiles undoes what mmdebstrap copies from the host into the
// chroot for the build and leaves behind: /etc/resolv.conf (the host's DNS
// servers) is removed and /etc/hostname (the host's name) is replaced by
// "forkvm" (the agent's handshake sets each VM's hostname anyway). The image
// then depends on nothing of the host that built it.
func scrubHostFiles(root string) error {
	etc := filepath.Join(root, "etc")
	if st, err := os.Lstat(etc); err != nil || !st.IsDir() {
		return nil
	}
	if err := os.Remove(filepath.Join(etc, "resolv.conf")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("guest: removing the build host's /etc/resolv.conf: %w", err)
	}
	hn := filepath.Join(etc, "hostname")
	if st, err := os.Lstat(hn); err == nil && st.Mode().IsRegular() {
		if err := os.WriteFile(hn, []byte("forkvm\n"), 0o644); err != nil {
			return fmt.Errorf("guest: resetting /etc/hostname: %w", err)
		}
	}
	return nil
}

// unknownPackages lists the packages apt reported it cannot find in
// mmdebstrap's output, sorted, without duplicates.
func unknownPackages(out string) []string {
	set := make(map[string]bool)
	for _, re := range unknownPackageREs {
		for _, m := range re.FindAllStringSubmatch(out, -1) {
			set[m[1]] = true
		}
	}
	var pkgs []string
	for p := range set {
		pkgs = append(pkgs, p)
	}
	sort.Strings(pkgs)
	return pkgs
}

// removeDevNodes removes the character and block devices directly in dir
// (not following a symlinked dir).
func removeDevNodes(dir string) error {
	st, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return nil
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if e.Type()&fs.ModeDevice != 0 {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return string(t.b) }
