package api

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestForkEventFaults: a fork event's fault classes survive a stream's line (JSON and
// back), a VM object's too; without them the line has no faults key, and a failed
// fork's line never carries any.
func TestForkEventFaults(t *testing.T) {
	fc := &FaultClasses{CopyOnWrite: 11, Holes: 22, SharedReads: 33, QEMU: 44}
	inf := Info{Name: "f1", PID: 7, Faults: fc}
	for _, tc := range []struct {
		name       string
		ev         ForkEvent
		want       *FaultClasses
		wantInWire bool
	}{
		{"ready with faults", ForkEvent{Index: 0, Name: "f1", VM: &inf, Faults: fc}, fc, true},
		{"ready, faults in the VM only", ForkEvent{Index: 0, Name: "f1", VM: &inf}, fc, true},
		{"ready without", ForkEvent{Index: 0, Name: "f2", VM: &Info{Name: "f2"}}, nil, false},
		{"failed", ForkEvent{Index: 1, Name: "f3", Err: ErrAdmission, Faults: fc}, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := json.Marshal(tc.ev.Object())
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Contains(string(b), `"faults":`); got != tc.wantInWire {
				t.Errorf("line %s: faults on the wire %v, want %v", b, got, tc.wantInWire)
			}
			var o ForkEventObject
			if err := json.Unmarshal(b, &o); err != nil {
				t.Fatal(err)
			}
			got := o.Event(SentinelOf(o.Code))
			switch {
			case tc.want == nil && got.Faults != nil:
				t.Errorf("faults %+v came back, want none", *got.Faults)
			case tc.want != nil && (got.Faults == nil || *got.Faults != *tc.want):
				t.Errorf("faults came back as %+v, want %+v", got.Faults, *tc.want)
			case tc.want != nil && (got.VM == nil || got.VM.Faults == nil || *got.VM.Faults != *tc.want):
				t.Errorf("the VM's faults came back as %+v", got.VM)
			}
		})
	}
	// The wire names are the CLI's and docs/profiling.md's.
	b, _ := json.Marshal(fc)
	if want := `{"cow":11,"holes":22,"shared_reads":33,"qemu":44}`; string(b) != want {
		t.Errorf("fault classes as JSON: %s, want %s", b, want)
	}
}
