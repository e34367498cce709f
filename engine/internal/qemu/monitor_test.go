package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu/qemutest"
	"github.com/forkvm/forkvm/qmp"
)

// newFake is a Monitor on a scripted QEMU: each command's reply comes from handle (nil:
// {}).
func newFake(t *testing.T, handle func(cmd string) (string, string)) (*Monitor, *qemutest.QMP) {
	t.Helper()
	f := qemutest.NewQMP(func(cmd string, _ json.RawMessage) (string, string) {
		if handle == nil {
			return "{}", ""
		}
		return handle(cmd)
	})
	c, err := qmp.NewClient(context.Background(), f.Pipe(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return NewMonitor(c), f
}

// call is the command cmd with args (compact JSON; "" without arguments).
func call(cmd, args string) qemutest.Call { return qemutest.Call{Cmd: cmd, Args: args} }

// Every verb sends its command with exactly the arguments QEMU's schema names.
func TestVerbsOnTheWire(t *testing.T) {
	tests := []struct {
		name string
		run  func(m *Monitor, ctx context.Context) error
		want qemutest.Call
	}{
		{"stop", (*Monitor).Stop, call("stop", "")},
		{"cont", (*Monitor).Cont, call("cont", "")},
		{"quit", (*Monitor).Quit, call("quit", "")},
		{"caps", func(m *Monitor, ctx context.Context) error {
			return m.MigrateSetCapabilities(ctx, map[string]bool{"x-ignore-shared": true, "events": false})
		}, call("migrate-set-capabilities", `{"capabilities":[{"capability":"events","state":false},{"capability":"x-ignore-shared","state":true}]}`)},
		{"params", func(m *Monitor, ctx context.Context) error {
			return m.MigrateSetParameters(ctx, MigrationParameters{MaxBandwidth: 1 << 40})
		}, call("migrate-set-parameters", `{"max-bandwidth":1099511627776}`)},
		{"migrate", func(m *Monitor, ctx context.Context) error { return m.Migrate(ctx, "file:/s") },
			call("migrate", `{"uri":"file:/s"}`)},
		{"incoming", func(m *Monitor, ctx context.Context) error { return m.MigrateIncoming(ctx, "file:/s") },
			call("migrate-incoming", `{"uri":"file:/s"}`)},
		{"cancel", (*Monitor).MigrateCancel, call("migrate_cancel", "")},
		{"save devices", func(m *Monitor, ctx context.Context) error { return m.XenSaveDevicesState(ctx, "/d") },
			call("xen-save-devices-state", `{"filename":"/d","live":false}`)},
		{"blockdev-add", func(m *Monitor, ctx context.Context) error {
			return m.BlockdevAdd(ctx, BlockdevQcow2{NodeName: "n1", Discard: "unmap", File: BlockdevFile{Filename: "/o.qcow2"}})
		}, call("blockdev-add", `{"driver":"qcow2","node-name":"n1","discard":"unmap","cache":{"no-flush":true},"file":{"driver":"file","filename":"/o.qcow2"},"backing":null}`)},
		{"blockdev-del", func(m *Monitor, ctx context.Context) error { return m.BlockdevDel(ctx, "n1") },
			call("blockdev-del", `{"node-name":"n1"}`)},
		{"set-active", func(m *Monitor, ctx context.Context) error { return m.BlockdevSetActive(ctx, true) },
			call("blockdev-set-active", `{"active":true}`)},
		{"snapshot", func(m *Monitor, ctx context.Context) error { return m.BlockdevSnapshot(ctx, "n0", "n1") },
			call("blockdev-snapshot", `{"node":"n0","overlay":"n1"}`)},
		{"stream", func(m *Monitor, ctx context.Context) error {
			return m.BlockStream(ctx, BlockStreamArgs{JobID: "j", Device: "top", BaseNode: "base", OnError: "report"})
		}, call("block-stream", `{"job-id":"j","device":"top","base-node":"base","auto-dismiss":false,"on-error":"report"}`)},
		{"dismiss", func(m *Monitor, ctx context.Context) error { return m.BlockJobDismiss(ctx, "j") },
			call("block-job-dismiss", `{"id":"j"}`)},
		{"node names", func(m *Monitor, ctx context.Context) error { _, err := m.QueryNodeNames(ctx); return err },
			call("query-named-block-nodes", `{"flat":true}`)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, f := newFake(t, func(cmd string) (string, string) {
				if cmd == "query-named-block-nodes" {
					return "[]", ""
				}
				return "{}", ""
			})
			if err := tt.run(m, context.Background()); err != nil {
				t.Fatal(err)
			}
			if got := f.Calls(); len(got) != 1 || got[0] != tt.want {
				t.Fatalf("sent %q, want %q", got, tt.want)
			}
		})
	}
}

// Results decode into their types, and a refusal keeps QEMU's *qmp.Error under the
// command's name.
func TestVerbResults(t *testing.T) {
	replies := map[string]string{
		"query-status":            `{"running":false,"status":"postmigrate","singlestep":false}`,
		"query-migrate":           `{"status":"active","ram":{"total":1}}`,
		"query-block":             `[{"device":"","io-status":"nospace","inserted":{"node-name":"disk-l2","backing_file_depth":2}},{"device":"cd"}]`,
		"query-named-block-nodes": `[{"node-name":"disk0"},{"node-name":"disk-l1"}]`,
		"x-query-jit":             `{"human-readable-text":"TB count 3\n"}`,
	}
	m, _ := newFake(t, func(cmd string) (string, string) {
		if r, ok := replies[cmd]; ok {
			return r, ""
		}
		return "no", "GenericError"
	})
	ctx := context.Background()
	if st, err := m.QueryStatus(ctx); err != nil || st != (StatusInfo{Running: false, Status: "postmigrate"}) {
		t.Errorf("QueryStatus = %+v, %v", st, err)
	}
	if mi, err := m.QueryMigrate(ctx); err != nil || !mi.Active() {
		t.Errorf("QueryMigrate = %+v, %v (want active)", mi, err)
	}
	blocks, err := m.QueryBlock(ctx)
	if err != nil || len(blocks) != 2 || blocks[0].IOStatus != "nospace" || blocks[1].Inserted != nil {
		t.Errorf("QueryBlock = %+v, %v", blocks, err)
	}
	if d, ok, err := m.ChainDepth(ctx, "disk-l2"); err != nil || !ok || d != 2 {
		t.Errorf("ChainDepth(disk-l2) = %d, %v, %v", d, ok, err)
	}
	if _, ok, err := m.ChainDepth(ctx, "other"); err != nil || ok {
		t.Errorf("ChainDepth(other) ok = %v, %v", ok, err)
	}
	if n, err := m.QueryNodeNames(ctx); err != nil || fmt.Sprint(n) != "[disk0 disk-l1]" {
		t.Errorf("QueryNodeNames = %v, %v", n, err)
	}
	if s, err := m.XQueryJIT(ctx); err != nil || s != "TB count 3\n" {
		t.Errorf("XQueryJIT = %q, %v", s, err)
	}
	err = m.Stop(ctx)
	var qerr *qmp.Error
	if !errors.As(err, &qerr) || qerr.Class != "GenericError" || err.Error() != "stop: qmp: GenericError: no" {
		t.Errorf("refused stop = %v", err)
	}
}

func TestMigrationActive(t *testing.T) {
	for status, want := range map[string]bool{"": false, "none": false, "setup": true, "active": true,
		"device": true, "postcopy-active": true, "completed": false, "failed": false, "cancelled": false} {
		if got := (MigrationInfo{Status: status}).Active(); got != want {
			t.Errorf("Active(%q) = %v, want %v", status, got, want)
		}
	}
}

func TestWaitMigration(t *testing.T) {
	tests := []struct {
		name    string
		replies []string // query-migrate replies in order; the last repeats
		wantErr error
	}{
		{"completed", []string{`{"status":"setup"}`, `{"status":"active"}`, `{"status":"completed"}`}, nil},
		{"failed", []string{`{"status":"active"}`, `{"status":"failed","error-desc":"disk full"}`}, ErrMigrationFailed},
		{"cancelled", []string{`{"status":"cancelled"}`}, ErrMigrationFailed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := 0
			m, _ := newFake(t, func(string) (string, string) {
				r := tt.replies[min(n, len(tt.replies)-1)]
				n++
				return r, ""
			})
			err := m.WaitMigration(context.Background())
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("WaitMigration = %v, want %v", err, tt.wantErr)
			}
		})
	}
}

// TestWaitMigrationInfo: the completed migration's totals, as QEMU reports them, come
// back with it.
func TestWaitMigrationInfo(t *testing.T) {
	replies := []string{`{"status":"active","ram":{"total":4096}}`,
		`{"status":"completed","total-time":12,"setup-time":1,"downtime":3,"ram":{"transferred":9000,"total":4096,"duplicate":7,"normal":2,"normal-bytes":8192}}`}
	n := 0
	m, _ := newFake(t, func(string) (string, string) {
		r := replies[min(n, len(replies)-1)]
		n++
		return r, ""
	})
	st, err := m.WaitMigrationInfo(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := MigrationInfo{Status: "completed", TotalTime: 12, SetupTime: 1, Downtime: 3,
		RAM: &MigrationRAM{Transferred: 9000, Total: 4096, Duplicate: 7, Normal: 2, NormalBytes: 8192}}
	if st.RAM == nil || *st.RAM != *want.RAM {
		t.Fatalf("RAM = %+v, want %+v", st.RAM, want.RAM)
	}
	st.RAM, want.RAM = nil, nil
	if st != want {
		t.Fatalf("WaitMigrationInfo = %+v, want %+v", st, want)
	}
}

func TestWaitBlockJob(t *testing.T) {
	polls := 0
	m, _ := newFake(t, func(string) (string, string) {
		polls++
		if polls < 3 {
			return `[{"type":"stream","device":"j1","len":10,"offset":5,"status":"running"},{"type":"stream","device":"other","status":"running"}]`, ""
		}
		return `[{"type":"stream","device":"j1","len":10,"offset":10,"status":"concluded","error":"boom"}]`, ""
	})
	j, err := m.WaitBlockJob(context.Background(), "j1")
	if err != nil || !j.Concluded() || j.Error != "boom" || j.Offset != 10 {
		t.Fatalf("WaitBlockJob = %+v, %v", j, err)
	}
	if _, err := m.WaitBlockJob(context.Background(), "gone"); !errors.Is(err, ErrNoSuchJob) {
		t.Fatalf("missing job: %v, want ErrNoSuchJob", err)
	}
}

func TestWaitBlockJobContext(t *testing.T) {
	m, _ := newFake(t, func(string) (string, string) {
		return `[{"type":"stream","device":"j1","status":"running"}]`, ""
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if _, err := m.WaitBlockJob(ctx, "j1"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want deadline", err)
	}
}
