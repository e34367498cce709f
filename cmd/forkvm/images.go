package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
)

// Root image commands: `forkvm image create`, `forkvm image rm` and
// `forkvm images`. Names belong to the state directory (--home), disks to the
// shared cache; they open no engine, so they never wait for a running one.

func cacheFlag() cli.Flag {
	return &cli.StringFlag{Name: "cache", Usage: "cache directory (default ~/.cache/forkvm)", Sources: cli.EnvVars("FORKVM_CACHE")}
}

// imageStore is the state directory's image names on the cache.
func imageStore(cmd *cli.Command) guest.ImageStore {
	home := cmd.String("home")
	if home == "" {
		home = engine.DefaultStateDir()
	}
	return guest.ImageStore{CacheDir: cmd.String("cache"), NamesDir: engine.ImageNamesDir(home)}
}

// defaultAgent is the forkvm-agent next to this binary, as `image build` uses.
func defaultAgent(cmd *cli.Command) (string, error) {
	if a := cmd.String("agent"); a != "" {
		return a, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	return filepath.Join(filepath.Dir(exe), "forkvm-agent"), nil
}

func imageCreateCmd() *cli.Command {
	return &cli.Command{
		Name:  "create",
		Usage: "build a root image: Debian (mmdebstrap), a registry image, a disk image, or a tarball, directory, OCI layout or docker-save archive",
		ArgsUsage: "NAME (--debian [--suite S] [--include P,...] | --from PATH|REGISTRY/REPO:TAG [--ref REF])\n\n" +
			"   Needs root. The image is an ext4 disk with the forkvm agent at\n" +
			"   " + guest.ImageAgentPath + ", stored by content hash in the cache, named in the\n" +
			"   state directory; `forkvm images` lists them. A Debian recipe built before is\n" +
			"   reused (--rebuild builds it again).\n\n" +
			"   --from is a path when that path exists. Otherwise, when it names a\n" +
			"   tag (:TAG), a digest (@sha256:...) or a registry host (HOST/...),\n" +
			"   it is pulled (linux/amd64) with ~/.docker/config.json's credentials,\n" +
			"   layers cached by digest. A disk image (raw or qcow2; GPT, MBR or bare\n" +
			"   ext4) gives its root partition's files: the GPT 'Linux root (x86-64)'\n" +
			"   one, else the largest ext2/3/4 one; so does an OCI artifact holding\n" +
			"   " + guest.DiskArtifactPath + ". forkvm's kernel and agent boot it (docs/images.md).",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "debian", Usage: "build a Debian minbase root with mmdebstrap"},
			&cli.StringFlag{Name: "suite", Usage: "Debian suite (with --debian)", Value: guest.DefaultSuite},
			&cli.StringSliceFlag{Name: "include", Usage: "extra Debian packages, comma-separated (with --debian)"},
			&cli.StringFlag{Name: "mirror", Usage: "Debian mirror URL (with --debian; default: mmdebstrap's)"},
			&cli.StringFlag{Name: "from", Usage: "root filesystem: .tar[.gz|.xz], directory, OCI layout, docker-save archive, disk image (raw, qcow2), or a registry reference"},
			&cli.BoolFlag{Name: "insecure", Usage: "pull over plain HTTP (with a registry --from; loopback registries are HTTP anyway)"},
			&cli.StringFlag{Name: "ref", Usage: "image to take from an OCI layout or docker-save archive holding several"},
			&cli.IntFlag{Name: "size-mb", Usage: "disk size in MiB (default: content + 1 GiB free, in 64 MiB steps)"},
			&cli.StringFlag{Name: "agent", Usage: "guest agent binary (default: forkvm-agent next to this binary)"},
			cacheFlag(),
			&cli.BoolFlag{Name: "rebuild", Usage: "build a Debian recipe again even if it was built before"},
			&cli.BoolFlag{Name: "json", Usage: "print the image as JSON"},
			&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no progress output"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 1 {
				return fmt.Errorf("usage: forkvm image create NAME (--debian [--suite S] [--include P,...] | --from PATH|REGISTRY/REPO:TAG)")
			}
			debian, from := cmd.Bool("debian"), cmd.String("from")
			if debian == (from != "") {
				return fmt.Errorf("forkvm image create: give exactly one of --debian and --from")
			}
			if !debian && (cmd.IsSet("suite") || cmd.IsSet("include") || cmd.IsSet("mirror")) {
				return fmt.Errorf("forkvm image create: --suite, --include and --mirror go with --debian")
			}
			agent, err := defaultAgent(cmd)
			if err != nil {
				return err
			}
			st := imageStore(cmd)
			cfg := &guest.ImageConfig{
				Name: cmd.Args().First(), CacheDir: st.CacheDir, NamesDir: st.NamesDir, From: from, Ref: cmd.String("ref"), Insecure: cmd.Bool("insecure"),
				AgentBinary: agent, SizeMiB: int(cmd.Int("size-mb")), Rebuild: cmd.Bool("rebuild"),
			}
			if !cmd.Bool("quiet") {
				cfg.Log = os.Stderr
			}
			if debian {
				cfg.Debian = &guest.DebianSource{Suite: cmd.String("suite"), Mirror: cmd.String("mirror")}
				for _, p := range cmd.StringSlice("include") {
					if p = strings.TrimSpace(p); p != "" {
						cfg.Debian.Include = append(cfg.Debian.Include, p)
					}
				}
			}
			img, err := guest.CreateImage(ctx, cfg)
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(newImageObject(img))
			}
			fmt.Printf("image %s: disk %s, %s of files (on a %s sparse disk)\n  %s\n", img.Name, img.Hash[:16],
				guest.FormatBytes(img.ContentBytes), guest.FormatBytes(img.DiskBytes), img.Disk)
			return nil
		},
	}
}

func imageRmCmd() *cli.Command {
	return &cli.Command{
		Name:      "rm",
		Usage:     "remove root images (and their disks when no other image shares them)",
		ArgsUsage: "NAME...",
		Flags:     []cli.Flag{cacheFlag()},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() == 0 {
				return errors.New("usage: forkvm image rm NAME (one or more)")
			}
			for _, name := range cmd.Args().Slice() {
				if err := imageStore(cmd).Remove(ctx, name); err != nil {
					return err
				}
				fmt.Println("removed image", name)
			}
			return nil
		},
	}
}

func imagesCmd() *cli.Command {
	return &cli.Command{
		Name:  "images",
		Usage: "list root images",
		Flags: []cli.Flag{cacheFlag(), &cli.BoolFlag{Name: "json", Usage: "print JSON"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			imgs, err := imageStore(cmd).List()
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				objs := make([]imageObject, 0, len(imgs))
				for _, img := range imgs {
					objs = append(objs, newImageObject(img))
				}
				return printJSON(objs)
			}
			return printImages(os.Stdout, imgs)
		},
	}
}

// imageObject is a root image as --json prints it (forkvm.image/v1): the schema name
// first, then guest.RootImage's snake_case fields, as every other --json object.
type imageObject struct {
	Schema string `json:"schema"`
	*guest.RootImage
}

func newImageObject(img *guest.RootImage) imageObject {
	return imageObject{Schema: api.ImageSchema, RootImage: img}
}

func printImages(w io.Writer, imgs []*guest.RootImage) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tHASH\tFILES\tDISK (SPARSE)\tSOURCE\tCREATED")
	for _, img := range imgs {
		hash := img.Hash
		if len(hash) > 16 {
			hash = hash[:16]
		}
		if img.Broken != "" {
			fmt.Fprintf(tw, "%s\t%s\tBROKEN: %s\t\t\t\n", img.Name, hash, img.Broken)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", img.Name, hash, guest.FormatBytes(img.ContentBytes), guest.FormatBytes(img.DiskBytes),
			describeSource(&img.Source), img.Created.Local().Format(time.DateTime))
	}
	return tw.Flush()
}

func describeSource(s *guest.ImageSource) string {
	switch s.Kind {
	case guest.SourceDebian:
		d := "debian " + s.Suite
		if len(s.Include) > 0 {
			d += " +" + strings.Join(s.Include, ",")
		}
		return d
	case "":
		return "?"
	}
	d := s.Kind + " " + s.Path
	if s.Kind == guest.SourceRegistry {
		d = s.Kind + " " + s.Image
	}
	if s.Ref != "" {
		d += " (" + s.Ref + ")"
	}
	return d
}

// imageCmd groups the guest image commands: build, create and rm.
func imageCmd() *cli.Command {
	return &cli.Command{
		Name:  "image",
		Usage: "guest image commands",
		Commands: []*cli.Command{{
			Name:  "build",
			Usage: "fetch the guest kernel and build the initramfs (cached by content hash)",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "agent", Usage: "guest agent binary (default: forkvm-agent next to this binary)"},
				&cli.StringFlag{Name: "cache", Usage: "cache directory", Sources: cli.EnvVars("FORKVM_CACHE")},
			},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				agent := cmd.String("agent")
				if agent == "" {
					exe, err := os.Executable()
					if err != nil {
						return err
					}
					agent = filepath.Join(filepath.Dir(exe), "forkvm-agent")
				}
				img, err := guest.Build(ctx, &guest.Config{CacheDir: cmd.String("cache"), AgentBinary: agent, Log: os.Stderr})
				if err != nil {
					return err
				}
				fmt.Printf("image %s: kernel %s\n  %s\n  %s\n", img.Hash, img.KernelVersion, img.Kernel, img.Initrd)
				return nil
			},
		}, imageCreateCmd(), imageRmCmd()},
	}
}
