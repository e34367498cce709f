//go:build !linux

package guest

import "os"

// checkNoMounts is a no-op outside Linux (no chroot builders run there).
func checkNoMounts(dir string) error { return nil }

// removeStaging removes a staging directory.
func removeStaging(dir string) error { return os.RemoveAll(dir) }
