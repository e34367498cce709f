package measure

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/tracebundle"
)

func TestParseVMStatAndPressure(t *testing.T) {
	vm := parseVMStat([]byte("nr_free_pages 100\npgfault 12345\npgmajfault 7\nthp_fault_alloc 3\npgscan_direct x\n"))
	if len(vm) != 3 || vm["pgfault"] != 12345 || vm["pgmajfault"] != 7 || vm["thp_fault_alloc"] != 3 {
		t.Fatalf("parseVMStat = %v", vm)
	}
	for _, tc := range []struct {
		text string
		want int64
		ok   bool
	}{
		{"some avg10=0.00 avg60=0.12 avg300=0.05 total=987654\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=5\n", 987654, true},
		{"full avg10=0.00 total=5\n", 0, false},
		{"some avg10=0.00 total=-3\n", -3, false},
		{"", 0, false},
	} {
		got, ok := parsePressureSome([]byte(tc.text))
		if ok != tc.ok || (ok && got != tc.want) {
			t.Errorf("%q: %d %v, want %d %v", tc.text, got, ok, tc.want, tc.ok)
		}
	}
}

// kallsymsText is the head of a guest's /proc/kallsyms (data symbols are skipped).
const kallsymsText = `ffffffff81000000 T _stext
ffffffff81000000 T startup_64
ffffffff81001000 t early_idt
ffffffff81200000 D some_data
ffffffff81300000 T clear_page_erms
ffffffff81300040 T clear_page_rep
`

func TestKallsymsRenameMap(t *testing.T) {
	k, err := parseKallsyms([]byte(kallsymsText))
	if err != nil {
		t.Fatal(err)
	}
	m := "7f0000001000 40 guest-0xffffffff81300012\n" + // in clear_page_erms
		"7f0000001040 20 guest-0x4010a0\n" + // guest user space: kept
		"7f0000001060 20 guest-0xffffffff81001004\n" +
		"7f0000001080 20 guest-0xffffffffc0000000\n" + // far past the last symbol: kept
		"7f00000010a0 20 something else\n"
	got := string(k.renameMap([]byte(m)))
	want := "7f0000001000 40 guest:clear_page_erms+0x12\n" +
		"7f0000001040 20 guest-0x4010a0\n" +
		"7f0000001060 20 guest:early_idt+0x4\n" +
		"7f0000001080 20 guest-0xffffffffc0000000\n" +
		"7f00000010a0 20 something else\n"
	if got != want {
		t.Fatalf("renameMap:\n%s\nwant:\n%s", got, want)
	}
	if _, err := parseKallsyms([]byte("0000000000000000 T _stext\n0000000000000000 T x\n")); err == nil {
		t.Fatal("all-zero kallsyms (kptr_restrict) accepted")
	}
}

// TestHostSamplerAndBundle: the sampler adds counter tracks to the trace; the run's
// bundle holds the spans, the kernel trace and perf script output and decodes.
func TestHostSamplerAndBundle(t *testing.T) {
	tr := NewTrace(time.Now())
	ram := filepath.Join(t.TempDir(), "ram")
	if err := os.WriteFile(ram, bytes.Repeat([]byte{1}, 1<<16), 0o600); err != nil {
		t.Fatal(err)
	}
	hs := StartHostSampler(tr, 10*time.Millisecond, ram)
	time.Sleep(60 * time.Millisecond)
	hc := hs.Finish()
	if hc.Samples < 2 {
		t.Fatalf("samples %d", hc.Samples)
	}
	if _, err := os.Stat("/proc/vmstat"); err == nil {
		if _, ok := hc.Deltas["pgfault"]; !ok {
			t.Errorf("no pgfault delta: %+v", hc)
		}
		if hc.CheckpointResidentMiB == nil || hc.CheckpointResidentMiB[1] <= 0 {
			t.Errorf("resident %v, want the written file's pages", hc.CheckpointResidentMiB)
		}
	}
	var counters int
	for _, e := range tr.events {
		if e.Ph == "C" {
			counters++
		}
	}
	if counters == 0 {
		t.Fatal("no counter events in the trace")
	}
	perfText, err := os.ReadFile("../../../../tracebundle/testdata/perf-script.txt")
	if err != nil {
		t.Fatal(err)
	}
	ftrace, err := os.ReadFile("../../../../tracebundle/testdata/ftrace.txt")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "out.perfetto.tar")
	if err := WriteBundle(path, tr, ftrace, perfText, "fork", "now"); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, err := tracebundle.Read(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Files) != 3 || b.Manifest.Perfetto.Attributes["forkvm.bench"] != "fork" {
		t.Fatalf("bundle files %d, manifest %+v", len(b.Files), b.Manifest)
	}
	var doc struct {
		TraceEvents []TraceEvent `json:"traceEvents"`
	}
	if err := json.Unmarshal(b.Files["forkvm-spans.json"], &doc); err != nil || len(doc.TraceEvents) != len(tr.events) {
		t.Fatalf("spans: %d events, %v", len(doc.TraceEvents), err)
	}
	if !strings.Contains(string(b.Files["ftrace.txt"]), "tracing_mark_write") {
		t.Fatal("ftrace member lost its markers")
	}
}
