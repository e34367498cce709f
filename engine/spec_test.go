package engine

import (
	"errors"
	"math/rand"
	"path/filepath"
	"strings"
	"testing"
	"unicode"
)

func TestValidateName(t *testing.T) {
	valid := []string{
		"a", "w1", "A-b_c.d", "0", "9lives", "base.v2", "x-", "x_", "x.",
		strings.Repeat("a", MaxNameLen),
		"a" + strings.Repeat("-_.9Z", (MaxNameLen-1)/5),
	}
	for _, n := range valid {
		if err := ValidateName(n); err != nil {
			t.Errorf("ValidateName(%q) = %v, want nil", n, err)
		}
	}
	invalid := []string{
		"", strings.Repeat("a", MaxNameLen+1), strings.Repeat("b", 1000),
		"a,b", "a/b", "/a", "a/", "..", ".", ".hidden", "-x", "_x", "a b", " a", "a ",
		"a\x00b", "a\n", "a\tb", "a\\b", "a:b", "a=b", "a;b", "a$b", "a*b", "a'b", "a\"b",
		"é", "aé", "naïve", "a\u200bb", "ａ", "\xff", "a\xffb",
	}
	for _, n := range invalid {
		err := ValidateName(n)
		if err == nil {
			t.Errorf("ValidateName(%q) = nil, want error", n)
			continue
		}
		if !errors.Is(err, ErrInvalidName) {
			t.Errorf("ValidateName(%q) = %v, not ErrInvalidName", n, err)
		}
	}
}

// TestValidateNameLongErrorMessage checks the too-long error does not echo a huge name.
func TestValidateNameLongErrorMessage(t *testing.T) {
	err := ValidateName(strings.Repeat("x", 100000))
	if err == nil || len(err.Error()) > 300 {
		t.Errorf("error for a 100000-byte name is %d bytes", len(err.Error()))
	}
}

// TestValidateNameEmbeddedDotDot: names cannot contain "..", not even inside.
func TestValidateNameEmbeddedDotDot(t *testing.T) {
	for _, n := range []string{"a..b", "a..", "a...b", "x.y..z"} {
		if err := ValidateName(n); !errors.Is(err, ErrInvalidName) {
			t.Errorf("ValidateName(%q) = %v, want ErrInvalidName", n, err)
		}
	}
}

// randomName draws a name-like string of bytes from the whole 0-255 range: a third of
// the time uniformly, otherwise mostly from the name alphabet with a 5% chance per byte of
// any byte at all (so that accepted names are frequent enough to exercise the property).
func randomName(r *rand.Rand) string {
	const alpha = "abzAZ09._-."
	n := r.Intn(MaxNameLen + 8)
	b := make([]byte, n)
	uniform := r.Intn(3) == 0
	for i := range b {
		if uniform || r.Intn(20) == 0 {
			b[i] = byte(r.Intn(256))
		} else {
			b[i] = alpha[r.Intn(len(alpha))]
		}
	}
	return string(b)
}

func TestValidateNameProperty(t *testing.T) {
	r := rand.New(rand.NewSource(20240601))
	accepted := 0
	var dotdot []string
	for i := 0; i < 5000; i++ {
		name := randomName(r)
		if ValidateName(name) != nil {
			continue
		}
		accepted++
		if strings.ContainsAny(name, ",/\x00") {
			t.Errorf("accepted %q: contains ',', '/' or NUL", name)
		}
		if strings.IndexFunc(name, unicode.IsSpace) >= 0 {
			t.Errorf("accepted %q: contains whitespace", name)
		}
		if len(name) == 0 || len(name) > MaxNameLen {
			t.Errorf("accepted %q: length %d", name, len(name))
		}
		if filepath.Base(name) != name {
			t.Errorf("accepted %q: filepath.Base = %q", name, filepath.Base(name))
		}
		if strings.Contains(name, "..") {
			dotdot = append(dotdot, name)
		}
	}
	if accepted < 500 {
		t.Errorf("only %d of 5000 random names accepted; the generator does not exercise the property", accepted)
	}
	if len(dotdot) > 0 {
		t.Run("no-dotdot", func(t *testing.T) {
			t.Errorf("%d accepted names (of %d) contain \"..\", e.g. %q", len(dotdot), accepted, dotdot[0])
		})
	}
}

func TestSpecValidate(t *testing.T) {
	ok := Spec{Name: "w1", CPUs: 1, MemoryMiB: 64}
	for _, tc := range []struct {
		name string
		mod  func(*Spec)
		want error // nil = valid
	}{
		{"minimal", func(s *Spec) {}, nil},
		{"max", func(s *Spec) { s.CPUs, s.MemoryMiB, s.DiskMiB = 64, 256*1024, 1024*1024 }, nil},
		{"forkable with disk", func(s *Spec) { s.Forkable, s.DiskMiB, s.MemoryMiB = true, 8, 512 }, nil},
		{"0 cpus", func(s *Spec) { s.CPUs = 0 }, ErrInvalidSpec},
		{"negative cpus", func(s *Spec) { s.CPUs = -1 }, ErrInvalidSpec},
		{"65 cpus", func(s *Spec) { s.CPUs = 65 }, ErrInvalidSpec},
		{"memory 63", func(s *Spec) { s.MemoryMiB = 63 }, ErrInvalidSpec},
		{"memory 62", func(s *Spec) { s.MemoryMiB = 62 }, ErrInvalidSpec},
		{"memory 257 odd", func(s *Spec) { s.MemoryMiB = 257 }, ErrInvalidSpec},
		{"memory 65 odd", func(s *Spec) { s.MemoryMiB = 65 }, ErrInvalidSpec},
		{"memory too big", func(s *Spec) { s.MemoryMiB = 256*1024 + 2 }, ErrInvalidSpec},
		{"disk 1", func(s *Spec) { s.DiskMiB = 1 }, ErrInvalidSpec},
		{"disk 7", func(s *Spec) { s.DiskMiB = 7 }, ErrInvalidSpec},
		{"disk negative", func(s *Spec) { s.DiskMiB = -8 }, ErrInvalidSpec},
		{"disk too big", func(s *Spec) { s.DiskMiB = 1024*1024 + 1 }, ErrInvalidSpec},
		{"empty name", func(s *Spec) { s.Name = "" }, ErrInvalidName},
		{"bad name", func(s *Spec) { s.Name = "a/b" }, ErrInvalidName},
		{"bad name wins over bad cpus", func(s *Spec) { s.Name, s.CPUs = "a,b", 0 }, ErrInvalidName},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := ok
			tc.mod(&s)
			err := ValidateSpec(s)
			switch {
			case tc.want == nil && err != nil:
				t.Errorf("Validate(%+v) = %v, want nil", s, err)
			case tc.want != nil && !errors.Is(err, tc.want):
				t.Errorf("Validate(%+v) = %v, want %v", s, err, tc.want)
			}
		})
	}
}

// TestSpecWithDefaults: a spec naming only the VM is valid once defaulted (POST /v1/vms
// with only a name failed "cpus must be 1..64, got 0"); set fields are kept.
func TestSpecWithDefaults(t *testing.T) {
	got := SpecWithDefaults(Spec{Name: "a"})
	if err := ValidateSpec(got); err != nil {
		t.Fatalf("a name-only spec: %v", err)
	}
	if got.CPUs != DefaultCPUs || got.MemoryMiB != DefaultMemoryMiB {
		t.Errorf("defaults: %+v", got)
	}
	got = SpecWithDefaults(Spec{Name: "a", CPUs: 4, MemoryMiB: 256})
	if got.CPUs != 4 || got.MemoryMiB != 256 {
		t.Errorf("set fields changed: %+v", got)
	}
	neg := SpecWithDefaults(Spec{Name: "a", CPUs: -1})
	if err := ValidateSpec(neg); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("negative cpus: %v", err)
	}
}
