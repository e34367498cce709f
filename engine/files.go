package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"time"

	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/tarstream"
	"github.com/forkvm/forkvm/vsockd"
)

// Files in and out of a VM, and its console.
//
// The engine never opens a host path on a guest's behalf: a copy moves a tar stream
// between the caller's reader or writer and the guest agent, which extracts (or writes)
// it in the guest. CopyInPath and CopyOutPath open the host path their caller names,
// with package tarstream, as the forkvm CLI does. Whoever extracts a stream the guest
// sent on the host must not trust it: tarstream.ExtractTar confines every entry to its
// destination (the forkvm CLI uses it with Top set to the source's base name).

// logPoll is how often Logs looks for new console output while following.
const logPoll = 200 * time.Millisecond

// CopyIn extracts the tar stream r into the guest directory guestDir, which must exist
// (else the error wraps ErrNotDirectory). The agent extracts while r is read, in Go, and
// writes nothing outside guestDir whatever the archive holds (ErrUnsafeEntry names an
// entry that tried; see tarstream.ExtractTar): modes and modification times are kept,
// owners are not (files belong to root), set-ID bits are dropped. An archive made with
// tarstream.WriteTar copies a file, a directory tree or a symlink. What was extracted
// before an error stays.
func (vm *VM) CopyIn(ctx context.Context, guestDir string, r io.Reader) error {
	return vm.withAgent(ctx, "copy", func(ctx context.Context, c *vsockd.Client) error { return c.CopyIn(ctx, guestDir, r) })
}

// CopyOut writes a tar stream of the guest path guestPath to w as the agent produces
// it: a file, a directory and everything below it, or a symlink as a symlink, in entries
// named after guestPath's base name (see tarstream.WriteTar). A missing guestPath wraps
// ErrSourceMissing. The stream comes from the guest: extract it with tarstream.ExtractTar
// (ExtractOptions.Top set to the base name), never with a tool that trusts it.
func (vm *VM) CopyOut(ctx context.Context, guestPath string, w io.Writer) error {
	return vm.withAgent(ctx, "copy", func(ctx context.Context, c *vsockd.Client) error { return c.CopyOut(ctx, guestPath, w) })
}

// CopyInPath copies the host path hostPath (a file, a directory tree or a symlink, as
// tarstream.WriteTar archives it) into the existing guest directory guestDir under its
// base name: CopyIn of a tar stream of hostPath, without the caller's pipe. A missing
// hostPath wraps ErrSourceMissing, a missing guestDir ErrNotDirectory.
func (vm *VM) CopyInPath(ctx context.Context, hostPath, guestDir string) error {
	return tarstream.CopyInPath(ctx, hostPath, func(r io.Reader) error { return vm.CopyIn(ctx, guestDir, r) })
}

// CopyOutPath copies the guest path guestPath into the existing host directory hostDir
// under its base name. The guest's stream is extracted with tarstream.ExtractTar: every
// entry must be below that name, and nothing is written outside hostDir. A missing
// guestPath wraps ErrSourceMissing. What was extracted before an error stays.
func (vm *VM) CopyOutPath(ctx context.Context, guestPath, hostDir string) error {
	name := path.Base(path.Clean(guestPath))
	if name == "/" || name == "." || name == ".." {
		return fmt.Errorf("%w: copy out of %q: name a file or directory below /", ErrInvalidSpec, guestPath)
	}
	pr, pw := io.Pipe()
	errc := make(chan error, 1)
	go func() {
		err := vm.CopyOut(ctx, guestPath, pw)
		pw.CloseWithError(err)
		errc <- err
	}()
	xerr := tarstream.ExtractTar(ctx, pr, hostDir, &tarstream.ExtractOptions{Top: name})
	// Unblock CopyOut if the extraction stopped first (it then aborts the stream).
	pr.CloseWithError(errors.Join(xerr, io.ErrClosedPipe))
	if cerr := <-errc; cerr != nil && (xerr == nil || !errors.Is(cerr, io.ErrClosedPipe)) {
		return cerr // the guest's own error says best what went wrong
	}
	return xerr
}

// Stat returns the attributes of the guest path guestPath (symlinks followed); a missing
// path matches fs.ErrNotExist.
func (vm *VM) Stat(ctx context.Context, guestPath string) (fs.FileInfo, error) {
	var fi fs.FileInfo
	err := vm.withAgent(ctx, "stat", func(ctx context.Context, c *vsockd.Client) error {
		var err error
		fi, err = c.Stat(ctx, guestPath)
		return err
	})
	return fi, err
}

// serialLog is the file QEMU writes the guest console to.
func (vm *VM) serialLog() string {
	p := vm.snapshot().Launch.SerialLog
	if p == "" {
		p = vm.path(serialLogFile)
	}
	return p
}

// Logs writes the guest's serial console to w: the kernel's messages and the agent's,
// as the VM's console keeper records them in StateDir/vms/NAME (the last MiB at most:
// older output is dropped). A fork's console starts with its checkpoint's, up to the
// checkpoint, and a line saying where the fork begins. Without follow it returns at
// the end of what was written so far. With follow it then keeps copying what the guest
// prints until the VM's QEMU exits (nil; a handoff checkpoint replaces the process, and
// ends the following too) or ctx ends (ctx's error). Logs reads files only: it works on
// a VM whose QEMU is gone.
func (vm *VM) Logs(ctx context.Context, follow bool, w io.Writer) error {
	if follow {
		// Nothing to follow: a parked VM's console has no QEMU behind it.
		if err := vm.errIfParked(); err != nil {
			return err
		}
	}
	p := vm.serialLog()
	fail := func(err error) error { return fmt.Errorf("engine: logs %s: %w", vm.Name(), err) }
	// The rotated half first (it may be missing).
	if old, err := os.Open(p + console.RotatedSuffix); err == nil {
		_, err := io.Copy(w, old)
		old.Close()
		if err != nil {
			return fail(err)
		}
	}
	f, err := os.Open(p)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if _, serr := os.Stat(p + console.RotatedSuffix); serr == nil && !follow {
				return nil
			}
			return fmt.Errorf("%w: %s has no console log", ErrNotFound, vm.Name())
		}
		return fail(err)
	}
	defer func() { f.Close() }()
	done := vm.Done()
	buf := make([]byte, 32<<10)
	var off int64
	// drain copies up to the current end of the file.
	drain := func() error {
		for {
			if err := ctx.Err(); err != nil {
				return err
			}
			n, err := f.Read(buf)
			if n > 0 {
				off += int64(n)
				if _, werr := w.Write(buf[:n]); werr != nil {
					return werr
				}
			}
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return fail(err)
			}
		}
	}
	if err := drain(); err != nil || !follow {
		return err
	}
	tick := time.NewTicker(logPoll)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-done:
			return drain()
		case <-tick.C:
		}
		if err := drain(); err != nil {
			return err
		}
		// The keeper rotated the log: what f holds is complete (drained above); go on
		// with the new file. A shorter file is a truncated one: start over.
		cur, err := os.Stat(p)
		if err != nil {
			continue
		}
		if st, err := f.Stat(); err == nil && !os.SameFile(st, cur) {
			nf, err := os.Open(p)
			if err != nil {
				continue
			}
			if err := drain(); err != nil { // what was written before the rotation
				nf.Close()
				return err
			}
			f.Close()
			f, off = nf, 0
		} else if err == nil && st.Size() < off {
			if _, err := f.Seek(0, io.SeekStart); err != nil {
				return fail(err)
			}
			off = 0
		}
		if err := drain(); err != nil {
			return err
		}
	}
}
