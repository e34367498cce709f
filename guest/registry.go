package guest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/forkvm/forkvm/internal/durable"
)

// SourceRegistry is the ImageSource.Kind of an image pulled from a registry.
const SourceRegistry = "registry"

// ErrRegistryPull means a registry pull failed for another reason than a missing
// image (ErrSourceNotFound): the registry is unreachable, refused the credentials,
// or sent a blob that does not match its digest. The message carries the
// registry's answer.
var ErrRegistryPull = errors.New("guest: registry pull failed")

// IsRegistryReference reports whether from, which names no existing file, is
// to be pulled from a registry: it parses as an image reference and names a
// tag (":TAG"), a digest ("@sha256:…") or a registry host (a first component
// with a "." or ":", or "localhost"). A path that exists is always a path: a
// bare word such as "rootfs.tar" that does not exist is reported as a missing
// file, not pulled from Docker Hub as library/rootfs.tar.
func IsRegistryReference(from string) bool {
	if from == "" || strings.HasPrefix(from, "/") || strings.HasPrefix(from, ".") {
		return false
	}
	if _, err := name.ParseReference(from); err != nil {
		return false
	}
	if strings.Contains(from, "@") {
		return true
	}
	last := from[strings.LastIndex(from, "/")+1:]
	if strings.Contains(last, ":") {
		return true
	}
	first, _, slash := strings.Cut(from, "/")
	return slash && (strings.ContainsAny(first, ".:") || first == "localhost")
}

// pullConfig is one registry pull.
type pullConfig struct {
	ref      string
	insecure bool   // allow plain HTTP for this registry (name.Insecure); TLS is still verified when used
	layers   string // <cache>/layers/sha256: compressed layers by digest
	logf     func(format string, a ...any)
	keychain authn.Keychain // nil: authn.DefaultKeychain (~/.docker/config.json, credential helpers)
	// progressEvery is the interval between progress lines of a layer being
	// downloaded; 0 means 2 s.
	progressEvery time.Duration
}

// DiskArtifactPath is the file an OCI artifact carries a bootable disk image
// in: a layer whose org.opencontainers.image.title annotation names it, or a
// file at that path in the image's flattened layers.
const DiskArtifactPath = "disk/disk.img"

// pulledImage is what a pull found: an image to flatten, or a disk image file
// (an artifact's disk/disk.img layer, downloaded into the layer cache).
type pulledImage struct {
	img    v1.Image
	disk   string // path of the disk blob in the layer cache, when the artifact is a disk
	digest string // manifest digest
	ref    string // the reference as resolved (registry/repo:tag or @digest)
}

// pull resolves cfg.ref to its linux/amd64 image (an index is resolved by
// platform), downloads each layer not yet in the layer cache (verified
// against its digest, written to a temporary name and renamed, so the cache
// only ever holds whole layers), and returns an image whose layers read from
// the cache. ctx bounds every request and download.
func pull(ctx context.Context, cfg *pullConfig) (*pulledImage, error) {
	var opts []name.Option
	if cfg.insecure {
		opts = append(opts, name.Insecure)
	}
	ref, err := name.ParseReference(cfg.ref, opts...)
	if err != nil {
		return nil, fmt.Errorf("%w: registry reference %q: %v", ErrInvalidImageConfig, cfg.ref, err)
	}
	kc := cfg.keychain
	if kc == nil {
		kc = authn.DefaultKeychain
	}
	ropts := []remote.Option{remote.WithContext(ctx), remote.WithAuthFromKeychain(kc), remote.WithPlatform(guestPlatform)}
	cfg.logf("pulling %s", ref.Name())
	img, err := remote.Image(ref, ropts...)
	if err != nil {
		return nil, pullError(ctx, ref.Name(), err)
	}
	d, err := img.Digest()
	if err != nil {
		return nil, pullError(ctx, ref.Name(), err)
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, pullError(ctx, ref.Name(), err)
	}
	out := &pulledImage{digest: d.String(), ref: ref.Name()}
	if err := os.MkdirAll(cfg.layers, 0o700); err != nil {
		return nil, fmt.Errorf("guest: layer cache: %w", err)
	}
	// An artifact with a disk image layer: only that layer is needed.
	for _, l := range m.Layers {
		t := l.Annotations["org.opencontainers.image.title"]
		if t == DiskArtifactPath || (t == "disk.img" && !isTarMediaType(l.MediaType)) {
			rl, err := img.LayerByDigest(l.Digest)
			if err != nil {
				return nil, pullError(ctx, ref.Name(), err)
			}
			if out.disk, err = cacheLayer(ctx, cfg, rl, l.Digest, l.Size); err != nil {
				return nil, err
			}
			return out, nil
		}
	}
	rls, err := img.Layers()
	if err != nil {
		return nil, pullError(ctx, ref.Name(), err)
	}
	layers := make([]v1.Layer, 0, len(rls))
	for i, rl := range rls {
		if i < len(m.Layers) && !isTarMediaType(m.Layers[i].MediaType) {
			return nil, fmt.Errorf("%w: %s: layer %s has media type %s, not a tar layer (an artifact's disk image is found by its title annotation %q)",
				ErrCorruptArchive, ref.Name(), m.Layers[i].Digest, m.Layers[i].MediaType, DiskArtifactPath)
		}
		ld, err := rl.Digest()
		if err != nil {
			return nil, pullError(ctx, ref.Name(), err)
		}
		size, err := rl.Size()
		if err != nil {
			return nil, pullError(ctx, ref.Name(), err)
		}
		p, err := cacheLayer(ctx, cfg, rl, ld, size)
		if err != nil {
			return nil, err
		}
		mt, err := rl.MediaType()
		if err != nil {
			return nil, pullError(ctx, ref.Name(), err)
		}
		cl, err := partial.CompressedToLayer(&cachedLayer{path: p, digest: ld, size: size, mediaType: mt})
		if err != nil {
			return nil, fmt.Errorf("%w: layer %s: %v", ErrCorruptArchive, ld, err)
		}
		layers = append(layers, cl)
	}
	out.img = &cachedImage{Image: img, layers: layers}
	return out, nil
}

func isTarMediaType(mt types.MediaType) bool {
	return mt == "" || mt.IsLayer() || strings.Contains(string(mt), ".tar")
}

// pullError classifies a failed registry call: a missing repository, tag or
// manifest is ErrSourceNotFound, ctx's end is ctx's error, the rest
// ErrRegistryPull.
func pullError(ctx context.Context, ref string, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("pulling %s: %w", ref, cerr)
	}
	var te *transport.Error
	if errors.As(err, &te) {
		if te.StatusCode == http.StatusNotFound {
			return fmt.Errorf("%w: %s: %v", ErrSourceNotFound, ref, err)
		}
		for _, d := range te.Errors {
			if d.Code == transport.ManifestUnknownErrorCode || d.Code == transport.NameUnknownErrorCode {
				return fmt.Errorf("%w: %s: %v", ErrSourceNotFound, ref, err)
			}
		}
	}
	if strings.Contains(err.Error(), "no child with platform") {
		return fmt.Errorf("%w: %s has no linux/amd64 image: %v", ErrSourceNotFound, ref, err)
	}
	return fmt.Errorf("%w: %s: %v", ErrRegistryPull, ref, err)
}

// cacheLayer returns the path of layer digest d in the layer cache,
// downloading it first when it is not there. The download is counted for the
// progress lines, checked against d (go-containerregistry verifies the
// digest at the end of the stream) and renamed into place only when whole.
func cacheLayer(ctx context.Context, cfg *pullConfig, l v1.Layer, d v1.Hash, size int64) (string, error) {
	if d.Algorithm != "sha256" || len(d.Hex) != 64 || !isHex(d.Hex) {
		return "", fmt.Errorf("%w: layer digest %s is not sha256", ErrCorruptArchive, d)
	}
	final := filepath.Join(cfg.layers, d.Hex)
	if st, err := os.Stat(final); err == nil && st.Mode().IsRegular() && (size <= 0 || st.Size() == size) {
		cfg.logf("layer %s: cached (%s)", d.Hex[:12], FormatBytes(st.Size()))
		return final, nil
	}
	rc, err := l.Compressed()
	if err != nil {
		return "", pullError(ctx, d.String(), err)
	}
	defer rc.Close()
	f, err := os.CreateTemp(cfg.layers, ".tmp-"+d.Hex[:12]+"-")
	if err != nil {
		return "", fmt.Errorf("guest: layer cache: %w", err)
	}
	defer os.Remove(f.Name()) // after a successful rename there is nothing left to remove
	every := cfg.progressEvery
	if every <= 0 {
		every = 2 * time.Second
	}
	pw := &progressWriter{logf: cfg.logf, name: d.Hex[:12], total: size, every: every, last: time.Now()}
	h := sha256.New()
	cfg.logf("layer %s: downloading %s", d.Hex[:12], FormatBytes(size))
	n, err := io.Copy(io.MultiWriter(f, h, pw), ctxReader{ctx, rc})
	if err == nil {
		// A later pull trusts the cached layer by its size: flushed before its
		// rename, a power loss cannot leave it whole in size but not in data.
		err = durable.Fsync(f)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		if ctx.Err() != nil {
			return "", fmt.Errorf("pulling layer %s: %w", d.Hex[:12], ctx.Err())
		}
		var pe *fs.PathError
		if errors.As(err, &pe) {
			return "", fmt.Errorf("guest: layer cache: %w", err)
		}
		return "", fmt.Errorf("%w: layer %s: %v", ErrRegistryPull, d.Hex[:12], err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != d.Hex || (size > 0 && n != size) {
		return "", fmt.Errorf("%w: layer %s: got %d bytes with digest sha256:%s", ErrRegistryPull, d, n, got)
	}
	if err := os.Chmod(f.Name(), 0o400); err != nil {
		return "", fmt.Errorf("guest: layer cache: %w", err)
	}
	if err := os.Rename(f.Name(), final); err != nil {
		return "", fmt.Errorf("guest: layer cache: %w", err)
	}
	durable.Dir(cfg.layers)
	cfg.logf("layer %s: %s downloaded", d.Hex[:12], FormatBytes(n))
	return final, nil
}

// progressWriter logs a layer download's progress at most once per every.
type progressWriter struct {
	logf  func(format string, a ...any)
	name  string
	total int64
	done  int64
	every time.Duration
	last  time.Time
}

func (p *progressWriter) Write(b []byte) (int, error) {
	p.done += int64(len(b))
	if now := time.Now(); now.Sub(p.last) >= p.every {
		p.last = now
		if p.total > 0 {
			p.logf("layer %s: %s of %s (%d%%)", p.name, FormatBytes(p.done), FormatBytes(p.total), p.done*100/p.total)
		} else {
			p.logf("layer %s: %s", p.name, FormatBytes(p.done))
		}
	}
	return len(b), nil
}

// cachedLayer is a compressed layer read from the layer cache.
type cachedLayer struct {
	path      string
	digest    v1.Hash
	size      int64
	mediaType types.MediaType
}

func (l *cachedLayer) Digest() (v1.Hash, error)            { return l.digest, nil }
func (l *cachedLayer) Compressed() (io.ReadCloser, error)  { return os.Open(l.path) }
func (l *cachedLayer) Size() (int64, error)                { return l.size, nil }
func (l *cachedLayer) MediaType() (types.MediaType, error) { return l.mediaType, nil }

// cachedImage is a pulled image whose layers read from the layer cache
// (mutate.Extract reads an image's layers through Layers).
type cachedImage struct {
	v1.Image
	layers []v1.Layer
}

func (i *cachedImage) Layers() ([]v1.Layer, error) { return i.layers, nil }

// layerDir is the layer cache of a store: compressed layers by digest, shared
// by every pull on the cache (<cache>/layers/sha256/<hex>, 0400). Nothing
// removes them: `rm -r <cache>/layers` is safe between pulls.
func (d rootfsDirs) layerDir() string {
	return filepath.Join(filepath.Dir(d.base), "layers", "sha256")
}

// pullInto pulls the build's registry reference and writes its tree into x:
// the flattened layers, or the root file system of an artifact's disk image.
func (b *imageBuild) pullInto(ctx context.Context, x *extractor, tmp string) (*ImageSource, error) {
	p, err := pull(ctx, &pullConfig{ref: b.cfg.From, insecure: b.cfg.Insecure, layers: b.dirs.layerDir(), logf: b.logf})
	if err != nil {
		return nil, err
	}
	src := &ImageSource{Kind: SourceRegistry, Image: p.ref, Digest: p.digest}
	if p.disk != "" {
		b.logf("%s is a disk artifact (layer %s): reading the root file system of its disk", p.ref, DiskArtifactPath)
		return src, importDisk(ctx, x, p.disk, tmp, true)
	}
	if _, err := x.extractImage(ctx, p.img); err != nil {
		return nil, err
	}
	return src, nil
}
