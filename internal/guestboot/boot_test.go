package guestboot

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestLoadImage(t *testing.T) {
	tests := []struct {
		name         string
		meta         string
		files        []string
		kernel, init string // "" : ErrNoImage
	}{
		{"format v1 names", `{"hash":"h"}`, []string{"vmlinuz", "initrd.gz"}, "vmlinuz", "initrd.gz"},
		{"named files", `{"hash":"h","kernel":"vmlinux","initrd":"initrd.cpio"}`, []string{"vmlinux", "initrd.cpio"}, "vmlinux", "initrd.cpio"},
		{"a named file missing", `{"kernel":"vmlinux","initrd":"initrd.cpio"}`, []string{"vmlinuz", "initrd.cpio"}, "", ""},
		{"a name outside the directory", `{"kernel":"../vmlinux"}`, []string{"vmlinuz", "initrd.gz"}, "", ""},
		{"a hidden name", `{"kernel":".vmlinux"}`, []string{".vmlinux", "initrd.gz"}, "", ""},
		{"corrupt image.json", `{`, []string{"vmlinuz", "initrd.gz"}, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			os.WriteFile(filepath.Join(dir, "image.json"), []byte(tt.meta), 0o644)
			for _, f := range tt.files {
				os.WriteFile(filepath.Join(dir, f), []byte("x"), 0o644)
			}
			img, err := LoadImage(dir)
			if tt.kernel == "" {
				if !errors.Is(err, ErrNoImage) {
					t.Fatalf("LoadImage = %+v, %v; want ErrNoImage", img, err)
				}
				return
			}
			if err != nil || img.Kernel != filepath.Join(dir, tt.kernel) || img.Initrd != filepath.Join(dir, tt.init) {
				t.Fatalf("LoadImage = %+v, %v; want %s and %s", img, err, tt.kernel, tt.init)
			}
		})
	}
}
