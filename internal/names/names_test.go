package names

import "testing"

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"w1", true}, {"a.b-c_d", true}, {"9", true},
		{"", false}, {"-a", false}, {".a", false}, {"a..b", false}, {"a,b", false}, {"a/b", false},
		{"a b", false}, {"a\x00", false}, {"é", false}, {string(make([]byte, 49)), false},
	} {
		if err := Check(tc.name, 48); (err == nil) != tc.ok {
			t.Errorf("Check(%q) = %v, want ok %v", tc.name, err, tc.ok)
		}
	}
}

func TestCleanEntry(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"a", "a"}, {"./a/b/", "a/b"}, {".", "."}, {"a//b", "a/b"},
		{"", ""}, {"/etc", ""}, {"../x", ""}, {"a/../../x", ""}, {"a\x00b", ""},
	} {
		got, err := CleanEntry(tc.in)
		if tc.want == "" {
			if err == nil {
				t.Errorf("CleanEntry(%q) = %q, want an error", tc.in, got)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("CleanEntry(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}
