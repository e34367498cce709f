package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/serve/client"
	"github.com/forkvm/forkvm/tarstream"
	"github.com/forkvm/forkvm/vsockd"
)

// guestFiles is what cp needs of a VM.
type guestFiles interface {
	CopyIn(ctx context.Context, dir string, r io.Reader) error
	CopyOut(ctx context.Context, p string, w io.Writer) error
	Stat(ctx context.Context, p string) (fs.FileInfo, error)
}

// vmFiles is guestFiles of one VM through the API.
type vmFiles struct {
	cl   api.API
	name string
}

func (d vmFiles) CopyIn(ctx context.Context, dir string, r io.Reader) error {
	return d.cl.CopyIn(ctx, d.name, dir, r)
}
func (d vmFiles) CopyOut(ctx context.Context, p string, w io.Writer) error {
	return d.cl.CopyOut(ctx, d.name, p, w)
}
func (d vmFiles) Stat(ctx context.Context, p string) (fs.FileInfo, error) {
	return d.cl.Stat(ctx, d.name, p)
}

// vmPathRE matches VM:/path (the VM name rule of the engine).
var vmPathRE = regexp.MustCompile(`^([A-Za-z0-9][A-Za-z0-9_.-]*):(.*)$`)

// splitVMPath splits "VM:/path"; ok is false for a host path.
func splitVMPath(s string) (vm, p string, ok bool) {
	m := vmPathRE.FindStringSubmatch(s)
	if m == nil {
		return "", "", false
	}
	return m[1], m[2], true
}

func cpCmd() *cli.Command {
	return &cli.Command{
		Name:      "cp",
		Usage:     "copy a file, directory tree or symlink between the host and a VM (VM:/path on exactly one side)",
		ArgsUsage: "SRC DST",
		Description: "forkvm cp ./dir w1:/root          copies ./dir to /root/dir in w1 (into an existing directory)\n" +
			"forkvm cp w1:/etc/hostname ./h    copies to ./h (a new name, or over an existing file)\n" +
			"forkvm cp - w1:/root              extracts a tar stream from stdin into /root\n" +
			"forkvm cp w1:/var/log -           writes a tar stream of /var/log to stdout\n\n" +
			"Directories are copied recursively and symlinks as symlinks; permission bits\n" +
			"and modification times are kept, owners and set-ID bits are not. Nothing is\n" +
			"written outside DST, whatever the guest sends: a copy from a VM holding a\n" +
			"symlink whose target is absolute or leads out of the copied tree is refused\n" +
			"(a trap for whoever follows it later), unless --keep-links makes such links\n" +
			"as they are.",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "keep-links", Usage: "copying from a VM: make symlinks whose target is absolute or leads out of the copy as they are (refused by default)"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 2 {
				return fmt.Errorf("usage: forkvm cp SRC DST (one of them VM:/path)")
			}
			src, dst := cmd.Args().Get(0), cmd.Args().Get(1)
			svm, spath, sIn := splitVMPath(src)
			dvm, dpath, dIn := splitVMPath(dst)
			if sIn == dIn {
				return &usageError{msg: "forkvm cp: exactly one of SRC and DST must be VM:/path"}
			}
			name, guestPath := dvm, dpath
			if sIn {
				name, guestPath = svm, spath
			}
			if !path.IsAbs(guestPath) {
				return fmt.Errorf("forkvm cp: the guest path %q must be absolute", guestPath)
			}
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			c := vmFiles{cl, name}
			if dIn {
				return copyToGuest(ctx, c, src, dpath)
			}
			return copyFromGuest(ctx, c, spath, dst, cmd.Bool("keep-links"))
		},
	}
}

// copyToGuest copies the host path src ("-": a tar stream on stdin) to guestDst: into
// it when it is a directory, else as a new name (or over an existing file).
func copyToGuest(ctx context.Context, c guestFiles, src, guestDst string) error {
	if src == "-" {
		return c.CopyIn(ctx, guestDst, os.Stdin)
	}
	fi, err := os.Lstat(src)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: %s", vsockd.ErrSourceMissing, src)
		}
		return err
	}
	abs, err := filepath.Abs(src)
	if err != nil {
		return err
	}
	slash := strings.HasSuffix(guestDst, "/")
	guestDst = path.Clean(guestDst)
	dir, top := guestDst, filepath.Base(abs)
	gi, err := c.Stat(ctx, guestDst)
	switch {
	case err == nil && gi.IsDir():
	case err == nil:
		if fi.IsDir() || slash {
			return fmt.Errorf("%w: %s", vsockd.ErrNotDirectory, guestDst)
		}
		dir, top = path.Dir(guestDst), path.Base(guestDst)
	case errors.Is(err, fs.ErrNotExist):
		if slash {
			return fmt.Errorf("%w: %s: no such directory", vsockd.ErrNotDirectory, guestDst)
		}
		dir, top = path.Dir(guestDst), path.Base(guestDst)
	default:
		return err
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(tarstream.WriteTar(ctx, pw, src, top)) }()
	err = c.CopyIn(ctx, dir, pr)
	pr.CloseWithError(errors.Join(err, io.ErrClosedPipe)) // ends WriteTar if it still writes
	return err
}

// copyFromGuest copies the guest path guestSrc to the host path dst ("-": a tar stream
// on stdout): into dst when it is a directory, else as a new name (or over an existing
// file). The guest's archive is extracted with tarstream.ExtractTar: every entry must be
// below the name asked for, nothing is written outside dst, and a symlink leading out of
// the copy (absolute, or out of the tree) is refused unless keepLinks.
func copyFromGuest(ctx context.Context, c guestFiles, guestSrc, dst string, keepLinks bool) error {
	if dst == "-" {
		return c.CopyOut(ctx, guestSrc, os.Stdout)
	}
	name := path.Base(path.Clean(guestSrc))
	if name == "/" {
		return fmt.Errorf("forkvm cp: cannot copy the guest's / as a whole (copy its directories)")
	}
	slash := strings.HasSuffix(dst, "/")
	dst = filepath.Clean(dst)
	dir, opts := dst, &tarstream.ExtractOptions{Top: name}
	if keepLinks {
		opts.Links = tarstream.LinksKeep
	}
	st, err := os.Stat(dst)
	switch {
	case err == nil && st.IsDir():
	case err == nil || errors.Is(err, fs.ErrNotExist):
		if slash {
			return fmt.Errorf("%w: %s", vsockd.ErrNotDirectory, dst)
		}
		// A new name, or over an existing file (a directory is refused by the extraction).
		dir, opts.Rename = filepath.Dir(dst), filepath.Base(dst)
	default:
		return err
	}
	pr, pw := io.Pipe()
	errc := make(chan error, 1)
	go func() {
		err := c.CopyOut(ctx, guestSrc, pw)
		pw.CloseWithError(err)
		errc <- err
	}()
	xerr := tarstream.ExtractTar(ctx, pr, dir, opts)
	// Unblock CopyOut if the extraction stopped first (it then aborts the stream).
	pr.CloseWithError(errors.Join(xerr, io.ErrClosedPipe))
	cerr := <-errc
	var re *vsockd.RemoteError
	var de *client.Error
	// The guest's own error, or one that ended the copy before the extraction read it
	// (an unknown VM: not a "malformed archive"), says best what went wrong.
	if cerr != nil && (xerr == nil || errors.Is(xerr, cerr) || errors.As(cerr, &re) || errors.As(cerr, &de)) {
		return cerr
	}
	return xerr
}
