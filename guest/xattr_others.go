//go:build !linux

package guest

import "errors"

const xattrPrefix = "SCHILY.xattr."

// setXattr is not supported outside Linux: images are built on Linux hosts.
func setXattr(p, name string, value []byte) error {
	return errors.New("extended attributes are only kept on Linux")
}

// xattrRecords returns nil outside Linux.
func xattrRecords(p string) map[string]string { return nil }
