// Package names holds the two naming rules forkvm's packages share: names of things
// forkvm makes (VMs, checkpoints, root images), which become file, socket and QEMU option
// names, and names of entries in archives forkvm unpacks (root images, copies into and
// out of guests), which must stay inside their destination.
package names

import (
	"errors"
	"fmt"
	"path"
	"regexp"
	"strings"
)

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// Check reports what is wrong with a name of at most max bytes of [A-Za-z0-9_.-],
// starting with a letter or digit and never containing "..": such a name cannot hold a
// comma (a QEMU option separator), a slash, NUL or a parent reference, so it is used in
// paths and QEMU options without escaping. Callers wrap the error in their sentinel.
func Check(name string, max int) error {
	switch {
	case name == "":
		return errors.New("empty name")
	case len(name) > max:
		return fmt.Errorf("%q is longer than %d characters", name[:max]+"...", max)
	case strings.Contains(name, ".."):
		return fmt.Errorf("%q contains \"..\"", name)
	case !nameRE.MatchString(name):
		return fmt.Errorf("%q (allowed: letters, digits, '_', '.', '-'; must start with a letter or digit)", name)
	}
	return nil
}

// CleanEntry returns the root-relative, slash-separated clean form of an archive entry
// name ("." for the root itself), or an error saying why the name could leave the root.
// Callers wrap the error in their sentinel.
func CleanEntry(name string) (string, error) {
	switch {
	case name == "":
		return "", errors.New("empty name")
	case strings.IndexByte(name, 0) >= 0:
		return "", fmt.Errorf("%q has a NUL byte", name)
	case strings.HasPrefix(name, "/"):
		return "", fmt.Errorf("%q is an absolute path", name)
	}
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", fmt.Errorf("%q has a \"..\" component", name)
		}
	}
	return path.Clean(name), nil
}
