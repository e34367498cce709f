package measure

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

func TestTraceShape(t *testing.T) {
	t0 := time.Now()
	tr := NewTrace(t0)
	tr.Group(1, "wave8")
	tr.ForkSpans(1, 1, "w8-1", t0.Add(time.Millisecond), report.Phases{Prepare: time.Millisecond, Spawn: 50 * time.Millisecond, Restore: time.Millisecond, Agent: 100 * time.Millisecond}, nil,
		t0.Add(200*time.Millisecond), 20*time.Millisecond, map[string]any{"cpu_user_ms": 12.0})
	var nilTrace *Trace
	nilTrace.Span(1, 1, "x", "y", t0, time.Second, nil) // must not panic
	var buf bytes.Buffer
	if _, err := tr.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		TraceEvents []TraceEvent `json:"traceEvents"`
		OtherData   struct {
			Clock  string `json:"clock"`
			T0Mono int64  `json:"t0_mono_ns"`
		} `json:"otherData"`
	}
	if err := json.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	var spans []string
	var lastEnd float64
	for _, e := range doc.TraceEvents {
		if e.Ph != "X" {
			if e.Ph != "M" {
				t.Errorf("unexpected phase %q", e.Ph)
			}
			continue
		}
		spans = append(spans, e.Name)
		if e.Pid != 1 || e.Tid != 1 || e.Dur <= 0 || e.Args["cpu_user_ms"] != 12.0 {
			t.Errorf("bad span %+v", e)
		}
		if e.TS+1e-6 < lastEnd {
			t.Errorf("span %s at %v overlaps previous end %v", e.Name, e.TS, lastEnd)
		}
		lastEnd = e.TS + e.Dur
	}
	if got := strings.Join(spans, ","); got != "prepare,spawn,restore,agent,first-command" {
		t.Errorf("spans = %s", got)
	}
	// Timestamps are CLOCK_MONOTONIC microseconds: prepare started 1 ms after t0.
	if got := doc.TraceEvents[len(doc.TraceEvents)-5].TS - float64(doc.OtherData.T0Mono)/1e3; math.Abs(got-1000) > 0.01 {
		t.Errorf("prepare ts = t0 + %v us, want t0 + 1000", got)
	}
	if doc.OtherData.Clock != "CLOCK_MONOTONIC" {
		t.Errorf("otherData.clock = %q", doc.OtherData.Clock)
	}
	if now := float64(monoNow()) / 1e3; doc.OtherData.T0Mono <= 0 || math.Abs(float64(doc.OtherData.T0Mono)/1e3-now) > 60e6 {
		t.Errorf("t0_mono_ns %d is not CLOCK_MONOTONIC (now %v us)", doc.OtherData.T0Mono, now)
	}
}

// TestTraceEngineSpans: a fork the engine reported spans for is drawn at their own
// CLOCK_MONOTONIC times (not laid out from the caller's start), then its first command.
func TestTraceEngineSpans(t *testing.T) {
	t0 := time.Now()
	tr := NewTrace(t0)
	spans := []engine.Span{{Name: "prepare", StartMono: 5_000_000, EndMono: 6_000_000}, {Name: "agent", StartMono: 9_000_000, EndMono: 9_500_000}}
	tr.ForkSpans(1, 1, "f", t0, report.Phases{Prepare: time.Second, Spawn: time.Second}, spans, t0, time.Millisecond, nil)
	var got []string
	for _, e := range tr.events {
		if e.Ph == "X" {
			got = append(got, fmt.Sprintf("%s@%g+%g", e.Name, e.TS, e.Dur))
		}
	}
	want := []string{"prepare@5000+1000", "agent@9000+500", fmt.Sprintf("first-command@%g+1000", tr.us(t0))}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("spans %q, want %q", got, want)
	}
}
func TestStateDirOf(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want string
	}{
		// The console socket in STATEDIR/run/NAME, as the engine launches a VM.
		{[]string{"qemu-system-x86_64", "-name", "w1,debug-threads=on,process=forkvm-w1", "-chardev", "socket,id=qmp,path=/work/h/run/w1/qmp.sock,server=on,wait=off",
			"-chardev", "socket,id=console,path=/work/h/run/w1/console.sock,server=off"}, "/work/h"},
		{[]string{"qemu-system-x86_64", "-name", "f1,process=forkvm-f1", "-chardev", "socket,id=console,path=/tmp/a,,b/run/f1/console.sock,server=off"}, "/tmp/a,b"},
		// A run dir outside the state dir (a long state dir path): the disk names it.
		{[]string{"qemu-system-x86_64", "-name", "f1,process=forkvm-f1", "-chardev", "socket,id=console,path=/tmp/forkvm-ab12/f1/console.sock,server=off",
			"-blockdev", `{"driver":"qcow2","file":{"driver":"file","filename":"/very/long/home/vms/f1/disk1.qcow2"},"node-name":"d1"}`}, "/very/long/home"},
		{[]string{"qemu-system-x86_64", "-name", "f1,process=forkvm-f1", "-chardev", "socket,id=console,path=/tmp/forkvm-ab12/f1/console.sock,server=off"}, "run dir /tmp/forkvm-ab12"},
		// An older engine's console file.
		{[]string{"qemu-system-x86_64", "-name", "f1,process=forkvm-f1", "-chardev", "file,id=console,path=/work/homes/a/vms/f1/serial.log"}, "/work/homes/a"},
		{[]string{"qemu-system-x86_64", "-chardev", "socket,id=console,path=/x/run/f1/console.sock,server=off"}, ""},
		{[]string{"qemu-system-x86_64", "-m", "512"}, ""},
	} {
		if got := stateDirOf(tt.args); got != tt.want {
			t.Errorf("stateDirOf(%v) = %q, want %q", tt.args, got, tt.want)
		}
	}
	o := &report.OtherVMs{ByStateDir: map[string]int{"/b": 1, "/a": 3}, NotForkvm: 2}
	if got := report.OtherVMsText(6, o); got != "6 (forkvm VMs of 2 other state directories: /a 3, /b 1; 2 QEMU processes not forkvm's)" {
		t.Errorf("otherVMsText = %q", got)
	}
	if b, _ := json.Marshal(o); string(b) != `{"forkvm_by_state_dir":{"/a":3,"/b":1},"not_forkvm":2}` {
		t.Errorf("json %s", b)
	}
}
