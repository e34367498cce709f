package guest

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/forkvm/forkvm/internal/durable"
)

// TestCacheCommitsAreFlushed: what the image cache trusts by its size or its decoding
// alone is flushed before its rename, and its directory after: a cached layer (a later
// pull takes it by its size) and an installed disk with its content.json
// (contentComplete checks the disk's size). Unflushed, a power loss could leave a
// layer or disk of the right size whose data never reached the disk.
func TestCacheCommitsAreFlushed(t *testing.T) {
	requireImageTools(t)
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, dir string)
		want []string // shell patterns relative to dir, in order
	}{
		{"layer", func(t *testing.T, dir string) {
			l := static.NewLayer([]byte("a layer"), types.OCILayer)
			d, _ := l.Digest()
			cfg := &pullConfig{layers: dir, logf: t.Logf}
			if _, err := cacheLayer(context.Background(), cfg, l, d, 7); err != nil {
				t.Fatal(err)
			}
		}, []string{".tmp-*", "."}},
		{"disk", func(t *testing.T, dir string) {
			from := writeTestFile(t, t.TempDir(), "root.tar", tarOf(t, []entry{{name: "etc/", typ: '5'}, {name: "etc/hostname", data: "x\n"}}))
			if _, err := CreateImage(context.Background(), &ImageConfig{Name: "flushed", CacheDir: dir, From: from, AgentBinary: testAgent(t)}); err != nil {
				t.Fatal(err)
			}
		}, []string{"rootfs/.tmp-flushed-*/content/disk.ext4", "rootfs/.tmp-flushed-*/content/content.json", "rootfs/.tmp-flushed-*/content", "rootfs/sha256"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			synced := durable.Record(t)
			tc.run(t, dir)
			var got []string
			for _, p := range synced() {
				if r, err := filepath.Rel(dir, p); err == nil {
					got = append(got, r)
				}
			}
			i := 0
			for _, p := range got {
				if i < len(tc.want) {
					if ok, _ := filepath.Match(tc.want[i], p); ok {
						i++
					}
				}
			}
			if i != len(tc.want) {
				t.Fatalf("flushed %q, want %q in that order", got, tc.want)
			}
		})
	}
}
