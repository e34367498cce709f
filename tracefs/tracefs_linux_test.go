package tracefs

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"testing"
)

// TestRealInstance: on this host's tracefs (root only; mounted for the test if it is
// not), markers appear in the private instance's trace with the mono clock, in order,
// and Close removes the instance.
func TestRealInstance(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a tracefs instance")
	}
	in, err := Open(Options{Mount: true, Name: "forkvm-unittest-" + strings.TrimPrefix(t.Name(), "Test")})
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("tracefs cannot be used here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	dir := in.Dir()
	in.PhaseStart("f1", "spawn")
	in.PhaseEnd("f1", "spawn")
	var b bytes.Buffer
	if err := in.WriteTrace(&b); err != nil {
		t.Fatal(err)
	}
	clock, err := os.ReadFile(dir + "/trace_clock")
	if err != nil {
		t.Fatal(err)
	}
	if err := in.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("instance %s still there: %v", dir, err)
	}
	if !strings.Contains(string(clock), "[mono]") {
		t.Errorf("trace_clock %q: mono not selected", clock)
	}
	tr := b.String()
	s, f := strings.Index(tr, "S|"), strings.Index(tr, "F|")
	if s < 0 || f < s || !strings.Contains(tr, "|f1 spawn|") {
		t.Fatalf("trace lacks S then F markers for f1 spawn:\n%s", tr)
	}
}
