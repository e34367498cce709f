package guest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/internal/durable"
	"github.com/forkvm/forkvm/internal/guestboot"
)

// Root images: a real root filesystem on an ext4 disk, with the forkvm agent
// inside, that the engine attaches as a virtio-blk disk and the initramfs
// switches into (see the package documentation for the boot contract).
//
// They live in the cache directory, next to the kernel images:
//
//	<names>/<name>.json                       one record per image name (ImageStore.NamesDir)
//	<cache>/rootfs/names/<name>.json          the same, for a store without a NamesDir
//	<cache>/rootfs/sha256/<hash[:16]>/disk.ext4     the root disk (0400, sparse)
//	<cache>/rootfs/sha256/<hash[:16]>/content.json  hash, sizes, agent
//	<cache>/rootfs/refs/<hash[:16]>/<id>      the path of each name record using the disk
//	<cache>/rootfs/recipes/<key[:16]>.json    the disk a Debian recipe was built into
//	<cache>/rootfs/.lock                      held while a disk or name is installed or removed
//	<cache>/rootfs/.tmp-<name>-*              staging of a CreateImage in progress
//
// The rootfs directories are 0700 and disks 0400, like the engine's disks:
// an image holds whatever the source held (/etc/shadow, set-user-ID files
// owned by anyone while staged) and is its owner's alone.
//
// Disks are stored by content hash: two names with the same content (the
// same tree, agent and disk size) share one disk, and a disk directory
// never changes once installed, so a VM's copy-on-write overlay can use it
// as a backing file. Names are per ImageStore.NamesDir (the engine and the
// CLI use one per state directory), disks are shared by every store on the
// cache: a disk is removed with the last name record, in any store, that
// refers to it.
//
// A Debian build is also cached by its recipe (suite, packages, mirror,
// mmdebstrap's version, the agent and the requested size): the same recipe
// again reuses the disk without running mmdebstrap, unless
// ImageConfig.Rebuild asks for a fresh build (Debian's archive moves: a
// rebuild may install newer packages; a snapshot.debian.org mirror URL
// pins them). Builds are reproducible in content: mmdebstrap runs with
// SOURCE_DATE_EPOCH (it then drops its logs and caches and empties
// machine-id), host files are scrubbed, and the staged tree's mtimes are
// clamped to that epoch, so a recipe built twice from the same archive
// content gets the same content hash, hence the same disk.

// ImageAgentPath is where CreateImage installs the forkvm agent inside every
// root image, and what the initramfs executes after switching into it.
const ImageAgentPath = "/sbin/forkvm-agent"

// The boot contract of root images (see the package documentation): the
// kernel arguments the initramfs reads and the virtio-blk serials that name
// the disks independently of their probe order.
const (
	KernelArgRoot  = guestboot.KernelArgRoot  // forkvm.root=DISK: boot the root image on DISK
	KernelArgData  = guestboot.KernelArgData  // forkvm.data=DISK: mount DISK on /data
	RootDiskSerial = guestboot.RootDiskSerial // -device virtio-blk-pci,...,serial=forkvm-root
	DataDiskSerial = guestboot.DataDiskSerial // -device virtio-blk-pci,...,serial=forkvm-data
)

// MaxImageNameLen bounds image names, as engine.MaxNameLen bounds VM names.
const MaxImageNameLen = guestboot.MaxImageNameLen

// imageRecordFormat and contentFormat version the JSON files.
const (
	imageRecordFormat = guestboot.ImageRecordFormat
	contentFormat     = guestboot.ContentFormat
)

// ValidateImageName checks an image name with the rule engine.ValidateName
// applies to VM names: 1..MaxImageNameLen characters of [A-Za-z0-9_.-],
// starting with a letter or digit, never "..". Such a name is a safe file
// name in the cache. The rule is repeated here rather than imported: the
// guest package does not depend on the engine.
func ValidateImageName(name string) error { return guestboot.ValidateImageName(name) }

// DebianSource builds the root filesystem with `mmdebstrap --variant=minbase`.
type DebianSource struct {
	// Suite is the Debian suite or codename; "" means DefaultSuite (bookworm).
	Suite string
	// Include lists extra packages (e.g. "python3"); nil means minbase only.
	// A name apt cannot find fails with ErrUnknownPackage naming it.
	Include []string
	// Mirror is the Debian mirror URL; "" lets mmdebstrap choose
	// (deb.debian.org for Debian suites).
	Mirror string
}

// ImageConfig configures CreateImage. Exactly one of Debian and From is set.
type ImageConfig struct {
	// Name names the image in the cache (ValidateImageName); required.
	Name string
	// CacheDir is the cache directory; "" means DefaultCacheDir().
	CacheDir string
	// Debian, when non-nil, builds a Debian root filesystem with mmdebstrap.
	Debian *DebianSource
	// From, when not empty, is a root filesystem to import: a tar archive
	// (plain, gzip or xz), a directory, an OCI image layout directory
	// (oci-layout + index.json), an OCI layout in a tar archive, a
	// `docker save` archive, or a bootable disk image (raw or qcow2,
	// partitioned or a bare ext4 file system: see importDisk). The kind is
	// recognised from the content. A From that names no existing file and
	// is an image reference (IsRegistryReference: REGISTRY/REPO:TAG,
	// REPO@sha256:…) is pulled from its registry; a path that exists wins.
	From string
	// Insecure lets a registry pull use plain HTTP (a registry on
	// 127.0.0.1 or localhost is reached over HTTP anyway).
	Insecure bool
	// Ref selects one image of an OCI layout or docker-save archive holding
	// several (an org.opencontainers.image.ref.name annotation or a RepoTag);
	// "" means the only linux/amd64 image.
	Ref string
	// AgentBinary is the static forkvm agent (the one guest.Build puts in
	// the initramfs), installed at ImageAgentPath; required.
	AgentBinary string
	// SizeMiB is the disk size; 0 means automatic (see planDisk: content +
	// ext4 metadata + AutoHeadroomMiB, in steps of 64 MiB). A size the
	// content does not fit fails with ErrImageTooLarge.
	SizeMiB int
	// Log receives progress lines (and mmdebstrap's output); nil discards.
	Log io.Writer
	// NamesDir holds the image's name record (see ImageStore); "" means the
	// cache's own names directory.
	NamesDir string
	// Rebuild builds a Debian image even when its recipe was built before
	// (and records the new build for the recipe).
	Rebuild bool
}

// ImageStore is where root images live: their disks in CacheDir ("" means
// DefaultCacheDir()), stored by content hash and shared, and their names in
// NamesDir, so that two state directories on one cache neither see nor
// collide with each other's names. An empty NamesDir means the cache's own
// names directory, shared by every user of the cache.
type ImageStore struct {
	CacheDir string
	NamesDir string
}

// ImageSource records where an image came from.
type ImageSource struct {
	Kind    string   `json:"kind"`              // one of the Source* constants
	Path    string   `json:"path,omitempty"`    // absolute path of From
	Image   string   `json:"image,omitempty"`   // registry reference of a pulled image, as resolved
	Ref     string   `json:"ref,omitempty"`     // ImageConfig.Ref
	Digest  string   `json:"digest,omitempty"`  // manifest digest of an OCI or docker image
	Suite   string   `json:"suite,omitempty"`   // Debian suite
	Include []string `json:"include,omitempty"` // extra Debian packages
	Mirror  string   `json:"mirror,omitempty"`  // Debian mirror
}

// RootImage is a root image in the cache. Its JSON (what `forkvm images --json` and
// `image create --json` print, inside a forkvm.image/v1 object) is snake_case like
// every other forkvm JSON object; releases before forkvm.image/v1 printed
// diskBytes, contentBytes and agentSha256 and no schema. The cache's own
// content.json keeps its field names: it is a file format, not output.
type RootImage struct {
	Name    string      `json:"name"`
	Hash    string      `json:"hash"` // hex SHA-256 of the tree (agent included) and the disk size
	Source  ImageSource `json:"source"`
	Created time.Time   `json:"created"`
	// Disk is the path of the ext4 root disk (raw, sparse, read-only: attach
	// it through a copy-on-write overlay).
	Disk         string `json:"disk"`
	DiskBytes    int64  `json:"disk_bytes"`    // size of Disk
	ContentBytes int64  `json:"content_bytes"` // bytes of regular files in the tree
	Inodes       int64  `json:"inodes"`        // files, directories and symlinks in the tree
	// AgentSHA256 is the SHA-256 of the agent installed at ImageAgentPath:
	// the host can tell whether the image's agent is the one it expects.
	AgentSHA256 string `json:"agent_sha256"`
	// Broken is set by ListImages for an image whose record or disk is
	// unusable (LookupImage returns ErrCorruptImage for it); `forkvm image
	// rm` removes it.
	Broken string `json:"broken,omitempty"`
}

// nameRecord is names/<name>.json.
type nameRecord struct {
	Format  string      `json:"format"`
	Name    string      `json:"name"`
	Hash    string      `json:"hash"`
	Source  ImageSource `json:"source"`
	Created time.Time   `json:"created"`
}

// contentRecord is sha256/<hash[:16]>/content.json.
type contentRecord struct {
	Format       string `json:"format"`
	Hash         string `json:"hash"`
	DiskBytes    int64  `json:"diskBytes"`
	ContentBytes int64  `json:"contentBytes"`
	Inodes       int64  `json:"inodes"`
	AgentSHA256  string `json:"agentSha256"`
}

type rootfsDirs struct{ base, names, legacyNames, blobs, refs, recipes string }

func (st ImageStore) dirs() rootfsDirs {
	cacheDir := st.CacheDir
	if cacheDir == "" {
		cacheDir = DefaultCacheDir()
	}
	base := filepath.Join(cacheDir, "rootfs")
	d := rootfsDirs{base: base, legacyNames: filepath.Join(base, "names"), blobs: filepath.Join(base, "sha256"),
		refs: filepath.Join(base, "refs"), recipes: filepath.Join(base, "recipes")}
	d.names = d.legacyNames
	if st.NamesDir != "" {
		if abs, err := filepath.Abs(st.NamesDir); err == nil {
			d.names = abs
		}
	}
	return d
}

func (d rootfsDirs) record(name string) string { return filepath.Join(d.names, name+".json") }
func (d rootfsDirs) content(hash string) string {
	return filepath.Join(d.blobs, hash[:16])
}

// CreateImage builds a root image from cfg's source and stores it in the
// cache under cfg.Name:
//
//  1. the source is staged in <cache>/rootfs/.tmp-<name>-*/root: mmdebstrap
//     writes there, an archive or directory is extracted there through the
//     entry policy of the extractor (no path leaves the staging root; device
//     nodes, ".." and absolute names, escaping links are refused), an OCI or
//     docker image is flattened by go-containerregistry first;
//  2. the agent is installed at ImageAgentPath and the mount points the
//     guest needs are created (/dev /proc /sys /run /tmp /root /data);
//  3. the tree is hashed (summarize) and the disk sized (planDisk);
//  4. unless a disk of that hash is cached, `mkfs.ext4 -d` writes it;
//  5. the name record is linked in, failing with ErrImageExists if the name
//     was taken meanwhile.
//
// Every failure wraps one sentinel (ErrInvalidImageName, ErrImageExists,
// ErrInvalidImageConfig, ErrSourceNotFound, ErrCorruptArchive,
// ErrUnsafeEntry, ErrDeviceNode, ErrImageTooLarge, ErrUnknownPackage,
// ErrMmdebstrapMissing, ErrDebianBuild, ErrNeedRoot, ErrAgentMissing,
// ErrMkfsMissing, ErrMkfsFailed, ErrInvalidSize, or ctx's error) and leaves
// nothing behind: the staging directory is removed (after detaching any
// mount a killed mmdebstrap left in it) and nothing is installed in the
// cache. CreateImage needs root: file owners must be reproduced in the
// staging tree for mkfs to copy them, and mmdebstrap runs in root mode.
func CreateImage(ctx context.Context, cfg *ImageConfig) (*RootImage, error) {
	if cfg == nil {
		return nil, fmt.Errorf("%w: nil config", ErrInvalidImageConfig)
	}
	c := *cfg
	if err := ValidateImageName(c.Name); err != nil {
		return nil, err
	}
	b := &imageBuild{cfg: &c, logw: c.Log, dirs: ImageStore{CacheDir: c.CacheDir, NamesDir: c.NamesDir}.dirs()}
	if b.logw == nil {
		b.logw = io.Discard
	}
	if err := b.prepare(); err != nil {
		return nil, err
	}
	if img, err := b.reuseRecipe(ctx); img != nil || err != nil {
		return img, err
	}
	if b.recipe != nil {
		// One build per recipe at a time: a concurrent CreateImage of the same recipe
		// (two tests, two users) waits for this one and reuses its disk instead of
		// running mmdebstrap beside it.
		unlock, waited, err := b.lockRecipe(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		if waited && !c.Rebuild {
			if img, err := b.reuseRecipe(ctx); img != nil || err != nil {
				return img, err
			}
		}
	}

	start := time.Now()
	tmp, err := os.MkdirTemp(b.dirs.base, ".tmp-"+c.Name+"-")
	if err != nil {
		return nil, fmt.Errorf("guest: creating staging directory: %w", err)
	}
	defer func() {
		if err := removeStaging(tmp); err != nil {
			b.logf("%v", err)
		}
	}()
	root := filepath.Join(tmp, "root")
	if err := b.populate(ctx, root, tmp); err != nil {
		return nil, err
	}
	sum, err := summarize(ctx, root)
	if err != nil {
		return nil, err
	}
	plan, err := planDisk(sum, c.SizeMiB)
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s\x00%s\x00%d\x00", contentFormat, sum.Hash, plan.SizeBytes)
	hash := hex.EncodeToString(h.Sum(nil))
	content := contentRecord{
		Format: contentFormat, Hash: hash, DiskBytes: plan.SizeBytes,
		ContentBytes: sum.ContentBytes, Inodes: sum.Inodes, AgentSHA256: b.agentSum,
	}
	staged := filepath.Join(tmp, "content")
	cached := contentComplete(b.dirs.content(hash), hash)
	if cached {
		b.logf("disk %s is cached", hash[:16])
	} else if err := b.stageDisk(ctx, staged, root, sum, plan, &content); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	rec := nameRecord{Format: imageRecordFormat, Name: c.Name, Hash: hash, Source: *b.src, Created: time.Now().UTC()}
	if err := b.install(ctx, &rec, staged, cached); err != nil {
		return nil, err
	}
	b.logf("image %s: disk %s, %s of files on a %s sparse disk, in %s", c.Name, hash[:16], FormatBytes(sum.ContentBytes),
		FormatBytes(plan.SizeBytes), time.Since(start).Round(time.Millisecond))
	return rootImage(b.dirs, &rec, &content), nil
}

// imageBuild is one CreateImage call's state, shared by its steps.
type imageBuild struct {
	cfg      *ImageConfig
	dirs     rootfsDirs
	logw     io.Writer
	src      *ImageSource  // the name record's source; Kind and Digest filled by populate for From sources
	agent    []byte        // the agent binary installed at ImageAgentPath
	agentSum string        // its SHA-256, hex
	recipe   *debianRecipe // the Debian recipe being built, nil for other sources
}

func (b *imageBuild) logf(format string, a ...any) { fmt.Fprintf(b.logw, "guest: "+format+"\n", a...) }

// prepare checks everything CreateImage needs before it stages anything: the
// config, the agent, root, mkfs (and mmdebstrap for Debian), the cache
// directories, and that the name is free.
func (b *imageBuild) prepare() error {
	c := b.cfg
	src, err := checkImageConfig(c, b.dirs)
	if err != nil {
		return err
	}
	b.src = src
	if b.agent, err = readAgent(c.AgentBinary); err != nil {
		return err
	}
	sum := sha256.Sum256(b.agent)
	b.agentSum = hex.EncodeToString(sum[:])
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w (running as uid %d)", ErrNeedRoot, os.Geteuid())
	}
	if _, err := findMkfs(); err != nil {
		return err
	}
	if c.Debian != nil {
		if _, err := findMmdebstrap(); err != nil {
			return err
		}
	}
	dirs := b.dirs
	for _, d := range []string{dirs.base, dirs.names, dirs.blobs, dirs.refs, dirs.recipes} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("guest: creating image cache: %w", err)
		}
	}
	if err := os.Chmod(dirs.base, 0o700); err != nil { // also when made by hand
		return fmt.Errorf("guest: image cache: %w", err)
	}
	if _, err := os.Lstat(dirs.record(c.Name)); err == nil {
		return fmt.Errorf("%w: %q (remove it first: forkvm image rm %s)", ErrImageExists, c.Name, c.Name)
	}
	return nil
}

// reuseRecipe, for a Debian source, computes its recipe and returns the image
// linked to the disk an earlier build of the same recipe made (unless a
// rebuild is asked for); nil when the image must be built.
func (b *imageBuild) reuseRecipe(ctx context.Context) (*RootImage, error) {
	c := b.cfg
	if c.Debian == nil {
		return nil, nil
	}
	recipe, err := newDebianRecipe(ctx, c.Debian, b.agentSum, c.SizeMiB)
	if err != nil {
		return nil, err
	}
	b.recipe = recipe
	prev := findRecipe(b.dirs, recipe)
	switch {
	case prev != nil && !c.Rebuild:
		img, err := linkRecipe(ctx, b.dirs, prev, c.Name, b.src)
		if err != nil {
			return nil, err
		}
		b.logf("recipe %s was built on %s into disk %s: reusing it, mmdebstrap not run (--rebuild builds it again with the archive's current packages)",
			recipe.Key[:16], prev.Built.Local().Format(time.DateTime), img.Hash[:16])
		b.logf("image %s: %s of files on a %s sparse disk", img.Name, FormatBytes(img.ContentBytes), FormatBytes(img.DiskBytes))
		return img, nil
	case c.Rebuild:
		b.logf("recipe %s: building it again (rebuild asked for)", recipe.Key[:16])
	default:
		b.logf("recipe %s: not built before: building", recipe.Key[:16])
	}
	return nil, nil
}

// populate writes the image's tree into root (mmdebstrap, or the extractor
// for a From source), then the agent and the guest's mount points.
func (b *imageBuild) populate(ctx context.Context, root, tmp string) error {
	c := b.cfg
	switch {
	case c.Debian != nil:
		b.logf("building Debian %s (minbase%s) with mmdebstrap", c.Debian.Suite, plusList(c.Debian.Include))
		if err := buildDebian(ctx, c.Debian, root, tmp, b.logw); err != nil {
			return err
		}
		if err := clampTimes(ctx, root, time.Unix(debianSourceDateEpoch, 0)); err != nil {
			return err
		}
	default:
		if err := os.Mkdir(root, 0o755); err != nil {
			return fmt.Errorf("guest: creating staging directory: %w", err)
		}
		x := newExtractor(root, int64(c.SizeMiB)<<20, b.logf)
		if x.limit == 0 {
			// Sized to its content: bounded by the cache's disk, which holds the
			// staged tree and the disk image made of it, so that an archive declaring
			// more than fits (a compression bomb, a huge sparse entry) is refused
			// before its bytes fill the host's disk.
			x.limit, x.autoLimit = contentLimit(tmp), true
		}
		var s *ImageSource
		var err error
		if b.src.Kind == SourceRegistry {
			s, err = b.pullInto(ctx, x, tmp)
		} else {
			s, err = populateFrom(ctx, x, c.From, c.Ref, tmp)
		}
		if err != nil {
			return err
		}
		b.src.Kind, b.src.Digest = s.Kind, s.Digest
		if s.Image != "" {
			b.src.Image = s.Image
		}
		if x, err = b.takeDiskArtifact(ctx, x, root, tmp); err != nil {
			return err
		}
		if x.skipped > 0 {
			b.logf("skipped %d FIFOs and sockets", x.skipped)
		}
		b.logf("extracted %s %s", b.src.Kind, c.From)
	}
	if err := installAgent(root, b.agent); err != nil {
		return err
	}
	return ensureSkeleton(root)
}

// stageDisk writes the ext4 disk of root and its content record into the
// staged directory, ready to be renamed into the cache.
func (b *imageBuild) stageDisk(ctx context.Context, staged, root string, sum *treeSummary, plan *diskPlan, content *contentRecord) error {
	b.logf("writing the ext4 disk: %d inodes, %s of files, on a %s sparse disk", sum.Inodes, FormatBytes(sum.ContentBytes), FormatBytes(plan.SizeBytes))
	if err := os.Mkdir(staged, 0o700); err != nil {
		return fmt.Errorf("guest: staging disk: %w", err)
	}
	disk := filepath.Join(staged, "disk.ext4")
	if err := mkfsRoot(ctx, disk, root, plan, content.Hash); err != nil {
		return err
	}
	if err := os.Chmod(disk, 0o400); err != nil {
		return fmt.Errorf("guest: staging disk: %w", err)
	}
	// The installed disk is trusted by its size and content.json by its decoding
	// (contentComplete): both are flushed before install renames them into place.
	if err := durable.File(disk); err != nil {
		return fmt.Errorf("guest: staging disk: %w", err)
	}
	j, _ := json.MarshalIndent(content, "", "  ")
	cj := filepath.Join(staged, "content.json")
	if err := os.WriteFile(cj, append(j, '\n'), 0o600); err != nil {
		return fmt.Errorf("guest: staging disk: %w", err)
	}
	if err := durable.File(cj); err != nil {
		return fmt.Errorf("guest: staging disk: %w", err)
	}
	durable.Dir(staged)
	return nil
}

// install, under the image lock, renames the staged disk into the cache
// (unless it was cached) and links the name record to it; then it records
// a Debian recipe's disk for the next build.
func (b *imageBuild) install(ctx context.Context, rec *nameRecord, staged string, cached bool) error {
	dirs, hash := b.dirs, rec.Hash
	unlock, err := lockImages(ctx, dirs)
	if err != nil {
		return err
	}
	defer unlock()
	final := dirs.content(hash)
	if !contentComplete(final, hash) {
		if cached { // removed by a concurrent RemoveImage since: cannot happen under the lock, but be exact
			return fmt.Errorf("guest: disk %s vanished while creating %q", hash[:16], rec.Name)
		}
		if err := os.RemoveAll(final); err != nil {
			return fmt.Errorf("guest: installing disk: %w", err)
		}
		if err := os.Rename(staged, final); err != nil {
			return fmt.Errorf("guest: installing disk: %w", err)
		}
		durable.Dir(dirs.blobs)
	}
	if err := linkRecord(dirs, rec); err != nil {
		if !cached {
			gcContent(dirs, hash) // not referenced by any name yet
		}
		return err
	}
	if b.recipe != nil {
		b.recipe.Hash, b.recipe.Built = hash, time.Now().UTC()
		if err := writeRecipe(dirs, b.recipe); err != nil {
			b.logf("%v (the next build of this recipe runs mmdebstrap again)", err)
		}
	}
	return nil
}

// checkImageConfig validates the source fields and fills defaults; it
// returns the source record without Kind and Digest for From sources.
func checkImageConfig(c *ImageConfig, dirs rootfsDirs) (*ImageSource, error) {
	if c.SizeMiB < 0 || (c.SizeMiB > 0 && c.SizeMiB < MinDiskMiB) || int64(c.SizeMiB) > 16<<20 {
		return nil, fmt.Errorf("%w: %d MiB (0 = automatic, else %d MiB to 16 TiB)", ErrInvalidSize, c.SizeMiB, MinDiskMiB)
	}
	switch {
	case c.Debian != nil && c.From != "":
		return nil, fmt.Errorf("%w: both a Debian source and From %q", ErrInvalidImageConfig, c.From)
	case c.Debian == nil && c.From == "":
		return nil, fmt.Errorf("%w: no source (set Debian or From)", ErrInvalidImageConfig)
	case c.Debian != nil:
		d := *c.Debian
		if d.Suite == "" {
			d.Suite = DefaultSuite
		}
		d.Include = append([]string(nil), d.Include...)
		if err := checkDebian(&d); err != nil {
			return nil, err
		}
		if c.Ref != "" {
			return nil, fmt.Errorf("%w: Ref is only for OCI and docker archives", ErrInvalidImageConfig)
		}
		if c.Insecure {
			return nil, fmt.Errorf("%w: Insecure is for registry pulls", ErrInvalidImageConfig)
		}
		c.Debian = &d
		return &ImageSource{Kind: SourceDebian, Suite: d.Suite, Include: d.Include, Mirror: d.Mirror}, nil
	}
	if _, err := os.Lstat(c.From); errors.Is(err, fs.ErrNotExist) && IsRegistryReference(c.From) {
		if c.Ref != "" {
			return nil, fmt.Errorf("%w: Ref is only for OCI and docker archives (a registry reference names its image)", ErrInvalidImageConfig)
		}
		return &ImageSource{Kind: SourceRegistry, Image: c.From}, nil
	} else if c.Insecure {
		return nil, fmt.Errorf("%w: Insecure is for registry pulls, and %s is a path", ErrInvalidImageConfig, c.From)
	}
	abs, err := filepath.Abs(c.From)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSourceNotFound, err)
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSourceNotFound, err)
	}
	c.From = real
	// A directory source must not contain the image cache (the walk would
	// read the staging tree it is writing) nor lie inside it.
	if base, err := filepath.Abs(dirs.base); err == nil {
		if rb, err := filepath.EvalSymlinks(filepath.Dir(base)); err == nil {
			base = filepath.Join(rb, filepath.Base(base))
		}
		if within(base, real) || within(real, base) {
			return nil, fmt.Errorf("%w: source %s overlaps the image cache %s", ErrInvalidImageConfig, real, base)
		}
	}
	return &ImageSource{Path: real, Ref: c.Ref}, nil
}

// within reports whether p is dir or below it.
func within(p, dir string) bool {
	r, err := filepath.Rel(dir, p)
	return err == nil && r != ".." && !strings.HasPrefix(r, ".."+string(filepath.Separator))
}

func plusList(pkgs []string) string {
	if len(pkgs) == 0 {
		return ""
	}
	return " + " + strings.Join(pkgs, ", ")
}

// readAgent reads the agent binary; it must be static (it runs as PID 1 in
// any userland, with or without a C library).
func readAgent(p string) ([]byte, error) {
	if p == "" {
		return nil, fmt.Errorf("%w: ImageConfig.AgentBinary is empty", ErrAgentMissing)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrAgentMissing, err)
	}
	if len(b) == 0 {
		return nil, fmt.Errorf("%w: %s is empty", ErrAgentMissing, p)
	}
	if isDynamicELF(b) {
		return nil, fmt.Errorf("%w: %s is dynamically linked; build it with CGO_ENABLED=0", ErrAgentMissing, p)
	}
	return b, nil
}

// contentComplete reports whether dir holds an installed disk of hash.
func contentComplete(dir, hash string) bool {
	c, err := readContent(dir)
	if err != nil || c.Hash != hash {
		return false
	}
	st, err := os.Stat(filepath.Join(dir, "disk.ext4"))
	return err == nil && st.Mode().IsRegular() && st.Size() == c.DiskBytes
}

func readContent(dir string) (*contentRecord, error) {
	b, err := os.ReadFile(filepath.Join(dir, "content.json"))
	if err != nil {
		return nil, err
	}
	var c contentRecord
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, err
	}
	if c.Format != contentFormat || len(c.Hash) != 64 {
		return nil, fmt.Errorf("unknown format %q", c.Format)
	}
	return &c, nil
}

// linkRecord writes names/<name>.json atomically and exclusively: a
// temporary file hard-linked to the final name, which fails if it exists.
func linkRecord(dirs rootfsDirs, rec *nameRecord) error {
	b, _ := json.MarshalIndent(rec, "", "  ")
	f, err := os.CreateTemp(dirs.names, ".tmp-"+rec.Name+"-")
	if err != nil {
		return fmt.Errorf("guest: writing image record: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("guest: writing image record: %w", err)
	}
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return fmt.Errorf("guest: writing image record: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("guest: writing image record: %w", err)
	}
	if err := os.Link(tmp, dirs.record(rec.Name)); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%w: %q", ErrImageExists, rec.Name)
		}
		return fmt.Errorf("guest: writing image record: %w", err)
	}
	if err := addRef(dirs, rec); err != nil {
		os.Remove(dirs.record(rec.Name))
		return err
	}
	return nil
}

// refID names the reference of a name record (by its path) in refs/<hash[:16]>.
func refID(record string) string {
	h := sha256.Sum256([]byte(record))
	return hex.EncodeToString(h[:16])
}

// addRef records that the name record of rec refers to its disk, so that removing
// a name in another store (another state directory) keeps the disk. The caller
// holds the lock.
func addRef(dirs rootfsDirs, rec *nameRecord) error {
	d := filepath.Join(dirs.refs, rec.Hash[:16])
	if err := os.MkdirAll(d, 0o700); err != nil {
		return fmt.Errorf("guest: image reference: %w", err)
	}
	p := dirs.record(rec.Name)
	if err := os.WriteFile(filepath.Join(d, refID(p)), []byte(p+"\n"), 0o600); err != nil {
		return fmt.Errorf("guest: image reference: %w", err)
	}
	return nil
}

// lockImages takes <cache>/rootfs/.lock exclusively. It is held only while
// a disk directory or name record is installed or removed (milliseconds),
// so waiting polls; ctx bounds the wait.
func lockImages(ctx context.Context, dirs rootfsDirs) (func(), error) {
	return flockPath(ctx, dirs.base, ".lock", 20*time.Millisecond, nil)
}

// lockRecipe takes the build lock of b's recipe, held while it is built (minutes);
// waited says another build of it held the lock first.
func (b *imageBuild) lockRecipe(ctx context.Context) (unlock func(), waited bool, err error) {
	unlock, err = flockPath(ctx, b.dirs.base, ".build-"+b.recipe.Key[:16]+".lock", 250*time.Millisecond, func() {
		waited = true
		b.logf("recipe %s is being built by another process: waiting for it", b.recipe.Key[:16])
	})
	return unlock, waited, err
}

// flockPath takes an exclusive flock on dir/name, polling every poll while another
// process holds it (onWait, when set, is called once when the wait begins); ctx bounds
// the wait. The returned func releases it.
func flockPath(ctx context.Context, dir, name string, poll time.Duration, onWait func()) (func(), error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("guest: image cache: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("guest: image cache lock: %w", err)
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil // closing releases the lock
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			return nil, fmt.Errorf("guest: image cache lock: %w", err)
		}
		if onWait != nil && errors.Is(err, unix.EWOULDBLOCK) {
			onWait()
			onWait = nil
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(poll):
		}
	}
}

func rootImage(dirs rootfsDirs, rec *nameRecord, c *contentRecord) *RootImage {
	return &RootImage{
		Name: rec.Name, Hash: rec.Hash, Source: rec.Source, Created: rec.Created,
		Disk: filepath.Join(dirs.content(rec.Hash), "disk.ext4"), DiskBytes: c.DiskBytes,
		ContentBytes: c.ContentBytes, Inodes: c.Inodes, AgentSHA256: c.AgentSHA256,
	}
}

// readRecord loads names/<name>.json.
func readRecord(dirs rootfsDirs, name string) (*nameRecord, error) {
	b, err := os.ReadFile(dirs.record(name))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %q", ErrImageNotFound, name)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %q: %v", ErrCorruptImage, name, err)
	}
	var rec nameRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, fmt.Errorf("%w: %q: %v", ErrCorruptImage, name, err)
	}
	if rec.Format != imageRecordFormat || rec.Name != name || len(rec.Hash) != 64 || !isHex(rec.Hash) {
		return nil, fmt.Errorf("%w: %q: bad record %s", ErrCorruptImage, name, dirs.record(name))
	}
	return &rec, nil
}

func isHex(s string) bool {
	_, err := hex.DecodeString(s)
	return err == nil
}

// LookupImage returns the image called name in cacheDir's own names
// (ImageStore with no NamesDir).
func LookupImage(cacheDir, name string) (*RootImage, error) {
	return ImageStore{CacheDir: cacheDir}.Lookup(name)
}

// Lookup returns the image called name: ErrInvalidImageName,
// ErrImageNotFound, or ErrCorruptImage when its record or disk is unusable.
func (st ImageStore) Lookup(name string) (*RootImage, error) {
	if err := ValidateImageName(name); err != nil {
		return nil, err
	}
	dirs := st.dirs()
	rec, err := readRecord(dirs, name)
	if err != nil {
		return nil, err
	}
	dir := dirs.content(rec.Hash)
	c, err := readContent(dir)
	if err != nil {
		return nil, fmt.Errorf("%w: %q: disk %s: %v", ErrCorruptImage, name, rec.Hash[:16], err)
	}
	if !contentComplete(dir, rec.Hash) {
		return nil, fmt.Errorf("%w: %q: disk %s is missing or has the wrong size", ErrCorruptImage, name, filepath.Join(dir, "disk.ext4"))
	}
	return rootImage(dirs, rec, c), nil
}

// ListImages lists cacheDir's own names (ImageStore with no NamesDir).
func ListImages(cacheDir string) ([]*RootImage, error) {
	return ImageStore{CacheDir: cacheDir}.List()
}

// List returns the store's images sorted by name; none is not an error. An
// image whose record or disk is unusable is listed with Broken set, so it can
// be seen and removed.
func (st ImageStore) List() ([]*RootImage, error) {
	dirs := st.dirs()
	ents, err := os.ReadDir(dirs.names)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("guest: listing images: %w", err)
	}
	var out []*RootImage
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || strings.HasPrefix(e.Name(), ".") || ValidateImageName(name) != nil {
			continue
		}
		img, err := st.Lookup(name)
		if err != nil {
			img = &RootImage{Name: name, Broken: err.Error()}
			if rec, rerr := readRecord(dirs, name); rerr == nil {
				img.Hash, img.Source, img.Created = rec.Hash, rec.Source, rec.Created
			}
		}
		out = append(out, img)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// RemoveImage removes name from cacheDir's own names (ImageStore with no
// NamesDir).
func RemoveImage(ctx context.Context, cacheDir, name string) error {
	return ImageStore{CacheDir: cacheDir}.Remove(ctx, name)
}

// Remove removes the image called name, and its disk when no name in any
// store on the cache refers to it any more. A broken image (ErrCorruptImage
// from Lookup) is removed too. It does not know which VMs use the disk as a
// backing file (the engine links the disk into each VM, so removing it
// breaks none). ctx bounds the wait for the cache lock.
func (st ImageStore) Remove(ctx context.Context, name string) error {
	if err := ValidateImageName(name); err != nil {
		return err
	}
	dirs := st.dirs()
	if _, err := os.Lstat(dirs.record(name)); errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: %q", ErrImageNotFound, name)
	}
	unlock, err := lockImages(ctx, dirs)
	if err != nil {
		return err
	}
	defer unlock()
	rec, rerr := readRecord(dirs, name)
	if errors.Is(rerr, ErrImageNotFound) {
		return rerr
	}
	if err := os.Remove(dirs.record(name)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: %q", ErrImageNotFound, name)
		}
		return fmt.Errorf("guest: removing image %q: %w", name, err)
	}
	if rerr == nil {
		os.Remove(filepath.Join(dirs.refs, rec.Hash[:16], refID(dirs.record(name))))
		return gcContent(dirs, rec.Hash)
	}
	return nil
}

// gcContent removes the disk directory of hash unless a name record still
// refers to it: one in the cache's own names directory, or one whose path a
// reference in refs/ names (stale references are dropped). The caller holds
// the lock.
func gcContent(dirs rootfsDirs, hash string) error {
	for _, names := range []string{dirs.legacyNames, dirs.names} {
		ents, err := os.ReadDir(names)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("guest: listing images: %w", err)
		}
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), ".") {
				continue
			}
			if refersTo(filepath.Join(names, e.Name()), hash) {
				return nil
			}
		}
	}
	refs := filepath.Join(dirs.refs, hash[:16])
	ents, _ := os.ReadDir(refs)
	for _, e := range ents {
		r := filepath.Join(refs, e.Name())
		b, err := os.ReadFile(r)
		if err != nil {
			continue
		}
		if refersTo(strings.TrimSpace(string(b)), hash) {
			return nil
		}
		os.Remove(r)
	}
	os.Remove(refs)
	if err := os.RemoveAll(dirs.content(hash)); err != nil {
		return fmt.Errorf("guest: removing disk %s: %w", hash[:16], err)
	}
	return nil
}

// refersTo reports whether the name record file p refers to hash (an
// unparsable record that mentions it counts: keep rather than lose a disk).
func refersTo(p, hash string) bool {
	b, err := os.ReadFile(p)
	if err != nil {
		return false
	}
	var rec nameRecord
	if json.Unmarshal(b, &rec) == nil && rec.Hash == hash {
		return true
	}
	return bytes.Contains(b, []byte(hash))
}

// FormatBytes prints a size for people: bytes under 1 KiB, else KiB, MiB or
// GiB with one decimal. Every size CreateImage and the CLI print uses it.
func FormatBytes(b int64) string {
	const unit = 1024
	if b < unit {
		return fmt.Sprintf("%d B", b)
	}
	v, u := float64(b)/unit, "KiB"
	for _, next := range []string{"MiB", "GiB", "TiB"} {
		if v < unit {
			break
		}
		v, u = v/unit, next
	}
	return fmt.Sprintf("%.1f %s", v, u)
}
