package guest

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/ulikunitz/xz"
)

// Source kinds recorded in ImageSource.Kind.
const (
	SourceDebian        = "debian"         // built with mmdebstrap
	SourceTarball       = "tarball"        // a root filesystem .tar, .tar.gz or .tar.xz
	SourceDirectory     = "directory"      // a root filesystem directory
	SourceOCILayout     = "oci-layout"     // an OCI image layout directory (oci-layout + index.json)
	SourceOCIArchive    = "oci-archive"    // an OCI image layout in a tar archive
	SourceDockerArchive = "docker-archive" // a `docker save` archive (manifest.json)
)

// The guest kernel is amd64: a multi-platform OCI index is resolved to its
// linux/amd64 image.
var guestPlatform = v1.Platform{OS: "linux", Architecture: "amd64"}

// openArchive opens a (possibly gzip- or xz-compressed) tar file and returns
// its uncompressed stream. Compression is recognised by its magic bytes, not
// the file name.
func openArchive(p string) (io.ReadCloser, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSourceNotFound, err)
	}
	br := bufio.NewReaderSize(f, 64<<10)
	magic, _ := br.Peek(6)
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(br)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("%w: %s: gzip: %v", ErrCorruptArchive, p, err)
		}
		return readCloser{zr, f}, nil
	case bytes.HasPrefix(magic, []byte{0xfd, '7', 'z', 'X', 'Z', 0}):
		zr, err := xz.NewReader(br)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("%w: %s: xz: %v", ErrCorruptArchive, p, err)
		}
		return readCloser{zr, f}, nil
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		f.Close()
		return nil, fmt.Errorf("%w: %s: zstd compression is not supported (use gzip or xz)", ErrCorruptArchive, p)
	case bytes.HasPrefix(magic, []byte("BZh")):
		f.Close()
		return nil, fmt.Errorf("%w: %s: bzip2 compression is not supported (use gzip or xz)", ErrCorruptArchive, p)
	}
	return readCloser{br, f}, nil
}

type readCloser struct {
	io.Reader
	c io.Closer
}

func (r readCloser) Close() error { return r.c.Close() }

// classifyArchive tells a root filesystem tarball from a `docker save`
// archive (top-level manifest.json) and an OCI layout archive (top-level
// oci-layout and index.json). It reads headers only, and stops at the first
// entry that has no place in an image archive (a root filesystem's "etc/",
// "./", "bin", ...), so a root tarball costs a few headers.
func classifyArchive(ctx context.Context, p string) (string, error) {
	rc, err := openArchive(p)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	var manifest, ociLayout, index bool
	for n := 0; ; n++ {
		if err := ctx.Err(); err != nil {
			return "", err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			if n == 0 {
				return "", fmt.Errorf("%w: %s: no entries", ErrCorruptArchive, p)
			}
			break
		}
		if err != nil {
			return "", fmt.Errorf("%w: %s: %v", ErrCorruptArchive, p, err)
		}
		top, _, _ := strings.Cut(strings.TrimPrefix(path.Clean(hdr.Name), "./"), "/")
		switch {
		case top == "manifest.json":
			manifest = true
		case top == "oci-layout":
			ociLayout = true
		case top == "index.json":
			index = true
		case top == "blobs", top == "repositories", isImageArchiveName(top):
		default:
			return SourceTarball, nil
		}
	}
	switch {
	case manifest:
		return SourceDockerArchive, nil
	case ociLayout && index:
		return SourceOCIArchive, nil
	}
	return SourceTarball, nil
}

// isImageArchiveName matches the blob names of `docker save` archives and
// of go-containerregistry's tarball.Write: "<64 hex>" layer directories,
// "<64 hex>.json" configs, "sha256:<64 hex>" configs and "<64
// hex>.tar[.gz]" layers. A root filesystem has no such top-level name.
func isImageArchiveName(s string) bool {
	s = strings.TrimPrefix(s, "sha256:")
	for _, suf := range []string{".json", ".tar.gz", ".tgz", ".tar"} {
		if t, ok := strings.CutSuffix(s, suf); ok {
			s = t
			break
		}
	}
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// dockerArchiveImage reads the image of a `docker save` archive. An archive
// with several images needs ref (one of its RepoTags).
func dockerArchiveImage(p, ref string) (v1.Image, error) {
	opener := func() (io.ReadCloser, error) { return openArchive(p) }
	m, err := tarball.LoadManifest(opener)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: manifest.json: %v", ErrCorruptArchive, p, err)
	}
	var tag *name.Tag
	if ref != "" {
		t, err := name.NewTag(ref)
		if err != nil {
			return nil, fmt.Errorf("%w: ref %q: %v", ErrInvalidImageConfig, ref, err)
		}
		tag = &t
		found := false
		for _, d := range m {
			for _, rt := range d.RepoTags {
				if rt2, err := name.NewTag(rt); err == nil && rt2.String() == t.String() {
					found = true
				}
			}
		}
		if !found {
			return nil, fmt.Errorf("%w: %s holds no image tagged %q (tags: %s)", ErrInvalidImageConfig, p, ref, dockerTags(m))
		}
	} else if len(m) != 1 {
		return nil, fmt.Errorf("%w: %s holds %d images; choose one with Ref (--ref; tags: %s)", ErrInvalidImageConfig, p, len(m), dockerTags(m))
	}
	img, err := tarball.Image(opener, tag)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrCorruptArchive, p, err)
	}
	return img, nil
}

func dockerTags(m tarball.Manifest) string {
	var tags []string
	for _, d := range m {
		tags = append(tags, d.RepoTags...)
	}
	if len(tags) == 0 {
		return "none"
	}
	return strings.Join(tags, ", ")
}

// Annotations naming an image in an OCI index.
var refAnnotations = []string{"org.opencontainers.image.ref.name", "io.containerd.image.name"}

// layoutImage reads the image of an OCI layout directory. Nested indexes
// (multi-platform images) are followed; images for another platform than
// linux/amd64 are ignored. Several candidates need ref, matched against the
// ref-name annotations.
func layoutImage(dir, ref string) (v1.Image, error) {
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("%w: OCI layout %s: %v", ErrCorruptArchive, dir, err)
	}
	type cand struct {
		img  v1.Image
		refs []string
	}
	var cands []cand
	var walk func(idx v1.ImageIndex, refs []string, depth int) error
	walk = func(idx v1.ImageIndex, refs []string, depth int) error {
		if depth > 4 {
			return fmt.Errorf("%w: OCI layout %s: indexes nested too deep", ErrCorruptArchive, dir)
		}
		im, err := idx.IndexManifest()
		if err != nil {
			return fmt.Errorf("%w: OCI layout %s: %v", ErrCorruptArchive, dir, err)
		}
		for _, d := range im.Manifests {
			r := append([]string(nil), refs...)
			for _, a := range refAnnotations {
				if v := d.Annotations[a]; v != "" {
					r = append(r, v)
				}
			}
			if d.Platform != nil && !d.Platform.Satisfies(guestPlatform) {
				continue
			}
			switch {
			case d.MediaType.IsIndex():
				child, err := idx.ImageIndex(d.Digest)
				if err != nil {
					return fmt.Errorf("%w: OCI layout %s: %v", ErrCorruptArchive, dir, err)
				}
				if err := walk(child, r, depth+1); err != nil {
					return err
				}
			case d.MediaType.IsImage():
				img, err := idx.Image(d.Digest)
				if err != nil {
					return fmt.Errorf("%w: OCI layout %s: %v", ErrCorruptArchive, dir, err)
				}
				cands = append(cands, cand{img, r})
			}
		}
		return nil
	}
	if err := walk(idx, nil, 0); err != nil {
		return nil, err
	}
	if ref != "" {
		var keep []cand
		for _, c := range cands {
			for _, r := range c.refs {
				if r == ref {
					keep = append(keep, c)
					break
				}
			}
		}
		if len(keep) == 0 {
			return nil, fmt.Errorf("%w: OCI layout %s has no linux/amd64 image named %q", ErrInvalidImageConfig, dir, ref)
		}
		cands = keep
	}
	switch len(cands) {
	case 0:
		return nil, fmt.Errorf("%w: OCI layout %s has no linux/amd64 image", ErrCorruptArchive, dir)
	case 1:
		return cands[0].img, nil
	}
	var names []string
	for _, c := range cands {
		names = append(names, strings.Join(c.refs, "|"))
	}
	return nil, fmt.Errorf("%w: OCI layout %s holds %d linux/amd64 images; choose one with Ref (--ref; names: %s)",
		ErrInvalidImageConfig, dir, len(cands), strings.Join(names, ", "))
}

// extractImage flattens img's layers with go-containerregistry's
// mutate.Extract (whiteouts and opaque directories applied, upper layers
// first) and writes the result through the extractor. mutate.Extract itself
// drops relative links that climb out of the root and fails on ".." paths;
// its failure is reported as ErrUnsafeEntry, a failure to read a layer as
// ErrCorruptArchive.
func (x *extractor) extractImage(ctx context.Context, img v1.Image) (digest string, err error) {
	d, err := img.Digest()
	if err != nil {
		return "", fmt.Errorf("%w: image digest: %v", ErrCorruptArchive, err)
	}
	rc := mutate.Extract(img)
	defer rc.Close()
	err = x.extractTar(ctx, rc)
	if err != nil && !errors.Is(err, errNoEntries) {
		return "", err
	}
	// mutate.Extract closes its tar stream (trailer included) before it
	// reports a failure, so a failed flatten looks like a complete, possibly
	// empty, archive: its error only comes after the trailer.
	if _, derr := io.Copy(io.Discard, rc); derr != nil {
		if strings.Contains(derr.Error(), "unsafe tar path") {
			return "", fmt.Errorf("%w: %v", ErrUnsafeEntry, derr)
		}
		return "", fmt.Errorf("%w: flattening layers: %v", ErrCorruptArchive, derr)
	}
	if err != nil {
		return "", err
	}
	return d.String(), x.finish()
}

// populateFrom fills root from ImageConfig.From and returns the source
// record. tmp is the staging directory (for an OCI archive's blobs).
func populateFrom(ctx context.Context, x *extractor, from, ref, tmp string) (*ImageSource, error) {
	fi, err := os.Stat(from)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSourceNotFound, err)
	}
	src := &ImageSource{Path: from, Ref: ref}
	if fi.IsDir() {
		if _, err := os.Stat(filepath.Join(from, "oci-layout")); err == nil {
			src.Kind = SourceOCILayout
			img, err := layoutImage(from, ref)
			if err != nil {
				return nil, err
			}
			src.Digest, err = x.extractImage(ctx, img)
			return src, err
		}
		if ref != "" {
			return nil, fmt.Errorf("%w: Ref is only for OCI and docker archives", ErrInvalidImageConfig)
		}
		src.Kind = SourceDirectory
		return src, x.copyTree(ctx, from)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s is neither a file nor a directory", ErrSourceNotFound, from)
	}
	if diskFormat(from) != "" {
		if ref != "" {
			return nil, fmt.Errorf("%w: Ref is only for OCI and docker archives", ErrInvalidImageConfig)
		}
		src.Kind = SourceDiskImage
		return src, importDisk(ctx, x, from, tmp, false)
	}
	kind, err := classifyArchive(ctx, from)
	if err != nil {
		return nil, err
	}
	src.Kind = kind
	switch kind {
	case SourceDockerArchive:
		img, err := dockerArchiveImage(from, ref)
		if err != nil {
			return nil, err
		}
		src.Digest, err = x.extractImage(ctx, img)
		return src, err
	case SourceOCIArchive:
		// Unpack the layout (blobs only: no links, no devices; the same
		// entry policy) next to the root, then read it as a directory.
		// go-containerregistry reads it on the host, following symlinks:
		// a link could name a host file or directory, so none is let in.
		dir := filepath.Join(tmp, "oci")
		if err := os.Mkdir(dir, 0o700); err != nil {
			return nil, err
		}
		ox := newExtractor(dir, 0, x.logf)
		ox.noLinks = true
		if err := extractFile(ctx, ox, from); err != nil {
			return nil, err
		}
		img, err := layoutImage(dir, ref)
		if err != nil {
			return nil, err
		}
		src.Digest, err = x.extractImage(ctx, img)
		if rerr := os.RemoveAll(dir); err == nil && rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
			err = rerr
		}
		return src, err
	}
	if ref != "" {
		return nil, fmt.Errorf("%w: Ref is only for OCI and docker archives", ErrInvalidImageConfig)
	}
	return src, extractFile(ctx, x, from)
}

// extractFile extracts a (compressed) tar file.
func extractFile(ctx context.Context, x *extractor, p string) error {
	rc, err := openArchive(p)
	if err != nil {
		return err
	}
	defer rc.Close()
	if err := x.extractTar(ctx, rc); err != nil {
		return err
	}
	return x.finish()
}
