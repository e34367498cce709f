// Package tarstream writes and extracts the tar streams a copy into or out of a forkvm
// VM carries: WriteTar archives a host (or guest) path, ExtractTar extracts an archive
// it does not trust, confined to one directory, and CopyInPath feeds a host path to a
// CopyIn-shaped function. The guest agent uses the same two functions on its end. The
// package links neither the engine nor the agent protocol, so a program that only talks
// to a daemon can copy files with it. Its errors wrap the api package's copy sentinels,
// re-exported here, and their messages keep the "vsockd:" prefix copies always had.
package tarstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"

	"github.com/forkvm/forkvm/api"
)

// The errors of copies, on either end (they are the api package's).
var (
	// ErrSourceMissing reports a path to copy that does not exist.
	ErrSourceMissing = api.ErrSourceMissing
	// ErrNotDirectory reports a copy destination that is missing or not a directory
	// (or a directory to be written over a non-directory).
	ErrNotDirectory = api.ErrNotDirectory
	// ErrUnsafeEntry reports an archive entry that would leave the destination
	// directory; the message names it.
	ErrUnsafeEntry = api.ErrUnsafeEntry
	// ErrBadArchive reports a malformed tar stream.
	ErrBadArchive = api.ErrBadArchive
)

// CopyInPath archives the host path hostPath (a file, a directory tree or a symlink, see
// WriteTar) under its base name and hands the stream to copyIn, which sends it on (a
// VM's or an API's CopyIn into a guest directory). WriteTar stops when copyIn returns. A
// missing hostPath wraps ErrSourceMissing before copyIn is called.
func CopyInPath(ctx context.Context, hostPath string, copyIn func(r io.Reader) error) error {
	if _, err := os.Lstat(hostPath); errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: %s", ErrSourceMissing, hostPath)
	} else if err != nil {
		return err
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(WriteTar(ctx, pw, hostPath, "")) }()
	err := copyIn(pr)
	pr.CloseWithError(errors.Join(err, io.ErrClosedPipe)) // ends WriteTar if it still writes
	return err
}
