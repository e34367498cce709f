package guest

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/ulikunitz/xz"
)

// moduleSubdirs are the parts of lib/modules/<version>/kernel that are
// unpacked into the cache (directories end in "/", other entries are file
// name prefixes); together they hold every module the initramfs needs plus
// their dependencies, at about a tenth of the full tree.
var moduleSubdirs = []string{
	"drivers/virtio/",
	"drivers/block/",
	"drivers/char/hw_random/",
	"net/vmw_vsock/",
	"lib/",
	"crypto/",
	// The virtio-net NIC (netModules) and its failover dependencies.
	"drivers/net/virtio_net.ko",
	"drivers/net/net_failover.ko",
	"net/core/failover.ko",
}

// debInfo describes what extractKernelDeb unpacked.
type debInfo struct {
	Package        string // from the control file, if present
	PackageVersion string // Debian version from the control file, if present
	Files          int    // files written
}

// arReader iterates over the members of a Unix ar archive (a .deb).
type arReader struct {
	r      *bufio.Reader
	remain int64 // bytes left in the current member
	pad    bool  // current member has a padding byte
}

func newArReader(r io.Reader) (*arReader, error) {
	br := bufio.NewReaderSize(r, 1<<16)
	magic := make([]byte, 8)
	if _, err := io.ReadFull(br, magic); err != nil || string(magic) != "!<arch>\n" {
		return nil, fmt.Errorf("%w: not an ar archive", ErrBadPackage)
	}
	return &arReader{r: br}, nil
}

// next skips to the next member and returns its name and size.
func (a *arReader) next() (string, int64, error) {
	skip := a.remain
	if a.pad {
		skip++
	}
	if _, err := io.CopyN(io.Discard, a.r, skip); err != nil {
		return "", 0, fmt.Errorf("%w: truncated ar member: %v", ErrBadPackage, err)
	}
	a.remain, a.pad = 0, false
	hdr := make([]byte, 60)
	if _, err := io.ReadFull(a.r, hdr); err != nil {
		if err == io.EOF {
			return "", 0, io.EOF
		}
		return "", 0, fmt.Errorf("%w: truncated ar header: %v", ErrBadPackage, err)
	}
	if string(hdr[58:60]) != "`\n" {
		return "", 0, fmt.Errorf("%w: bad ar header magic", ErrBadPackage)
	}
	name := strings.TrimSuffix(strings.TrimSpace(string(hdr[0:16])), "/")
	size, err := strconv.ParseInt(strings.TrimSpace(string(hdr[48:58])), 10, 64)
	if err != nil || size < 0 {
		return "", 0, fmt.Errorf("%w: bad ar member size %q", ErrBadPackage, hdr[48:58])
	}
	a.remain, a.pad = size, size%2 == 1
	return name, size, nil
}

func (a *arReader) Read(p []byte) (int, error) {
	if a.remain <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > a.remain {
		p = p[:a.remain]
	}
	n, err := a.r.Read(p)
	a.remain -= int64(n)
	if err == io.EOF && a.remain > 0 {
		err = io.ErrUnexpectedEOF
	}
	return n, err
}

// decompressor wraps r according to a deb member's file name suffix.
func decompressor(name string, r io.Reader) (io.Reader, error) {
	switch {
	case strings.HasSuffix(name, ".tar.xz"):
		cfg := xz.ReaderConfig{SingleStream: false}
		return cfg.NewReader(bufio.NewReaderSize(r, 1<<16))
	case strings.HasSuffix(name, ".tar.gz"):
		return gzip.NewReader(r)
	case strings.HasSuffix(name, ".tar"):
		return r, nil
	case strings.HasSuffix(name, ".tar.zst"):
		return nil, fmt.Errorf("%w: %s is zstd-compressed, which this pure-Go extractor does not support (use a Debian bookworm kernel package, whose data is xz-compressed)", ErrBadPackage, name)
	default:
		return nil, fmt.Errorf("%w: unsupported member compression %q", ErrBadPackage, name)
	}
}

// extractKernelDeb unpacks boot/vmlinuz-<version>, modules.builtin and the
// moduleSubdirs of lib/modules/<version>/kernel from the .deb at debPath into
// dest as dest/vmlinuz and dest/modules/... . Only regular files are written;
// paths escaping the tree are ignored.
func extractKernelDeb(debPath, dest, version string) (*debInfo, error) {
	f, err := os.Open(debPath)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	ar, err := newArReader(f)
	if err != nil {
		return nil, err
	}
	info := &debInfo{}
	sawData, sawKernel := false, false
	for {
		name, _, err := ar.next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		switch {
		case strings.HasPrefix(name, "control.tar"):
			r, err := decompressor(name, ar)
			if err != nil {
				return nil, err
			}
			if err := readControl(r, info); err != nil {
				return nil, err
			}
		case strings.HasPrefix(name, "data.tar"):
			sawData = true
			r, err := decompressor(name, ar)
			if err != nil {
				return nil, err
			}
			if sawKernel, err = extractData(r, dest, version, info); err != nil {
				return nil, err
			}
		}
	}
	if !sawData {
		return nil, fmt.Errorf("%w: no data.tar member", ErrBadPackage)
	}
	if !sawKernel {
		return nil, fmt.Errorf("%w: no boot/vmlinuz-%s in package", ErrBadPackage, version)
	}
	return info, nil
}

func readControl(r io.Reader, info *debInfo) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%w: control.tar: %v", ErrBadPackage, err)
		}
		if path.Clean(h.Name) != "control" {
			continue
		}
		b, err := io.ReadAll(io.LimitReader(tr, 1<<20))
		if err != nil {
			return fmt.Errorf("%w: control.tar: %v", ErrBadPackage, err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "Package:"); ok {
				info.Package = strings.TrimSpace(v)
			}
			if v, ok := strings.CutPrefix(line, "Version:"); ok {
				info.PackageVersion = strings.TrimSpace(v)
			}
		}
		// Drain the rest so the ar reader stays in sync (it skips anyway).
		return nil
	}
}

// wantedDataPath maps a data.tar member to its destination relative to the
// kernel cache dir, or "" when it is not needed.
func wantedDataPath(name, version string) string {
	p := path.Clean("/" + name)
	if p == "/boot/vmlinuz-"+version {
		return "vmlinuz"
	}
	modRoot := "/lib/modules/" + version + "/"
	rest, ok := strings.CutPrefix(p, modRoot)
	if !ok {
		// usrmerge layouts put modules under /usr/lib.
		if rest, ok = strings.CutPrefix(p, "/usr"+modRoot); !ok {
			return ""
		}
	}
	if rest == "modules.builtin" {
		return "modules/modules.builtin"
	}
	for _, sub := range moduleSubdirs {
		if strings.HasPrefix(rest, "kernel/"+sub) {
			return "modules/" + rest
		}
	}
	return ""
}

func extractData(r io.Reader, dest, version string, info *debInfo) (sawKernel bool, err error) {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return sawKernel, nil
		}
		if err != nil {
			return sawKernel, fmt.Errorf("%w: data.tar: %v", ErrBadPackage, err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		rel := wantedDataPath(h.Name, version)
		if rel == "" {
			continue
		}
		out := filepath.Join(dest, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
			return sawKernel, err
		}
		if err := writeFileFrom(out, tr, 0o644); err != nil {
			return sawKernel, fmt.Errorf("%w: extracting %s: %v", ErrBadPackage, h.Name, err)
		}
		info.Files++
		if rel == "vmlinuz" {
			sawKernel = true
		}
	}
}

func writeFileFrom(name string, r io.Reader, perm os.FileMode) error {
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// decompressModule returns the raw ELF bytes of a .ko, .ko.xz or .ko.gz file.
func decompressModule(name string) ([]byte, error) {
	raw, err := os.ReadFile(name)
	if err != nil {
		return nil, err
	}
	switch {
	case strings.HasSuffix(name, ".ko"):
		return raw, nil
	case strings.HasSuffix(name, ".ko.xz"):
		r, err := xz.NewReader(bytes.NewReader(raw))
		if err != nil {
			return nil, err
		}
		return io.ReadAll(r)
	case strings.HasSuffix(name, ".ko.gz"):
		r, err := gzip.NewReader(bytes.NewReader(raw))
		if err != nil {
			return nil, err
		}
		return io.ReadAll(r)
	case strings.HasSuffix(name, ".ko.zst"):
		return nil, errors.New("zstd-compressed modules are not supported")
	}
	return nil, fmt.Errorf("not a kernel module: %s", name)
}
