package admission

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkvm/forkvm/engine/internal/admission/admissiontest"
)

// fakeHost is a probe of a fake host with avail of total bytes of memory, no memory
// cgroup and no process.
func fakeHost(t *testing.T, total, avail int64) Probe {
	h := admissiontest.FakeHost(t, total, avail)
	return Probe{Proc: h.Proc, SelfCgroup: h.SelfCgroup, Mountinfo: h.Mountinfo}
}

// cmdline joins argv as /proc/PID/cmdline has it.
func cmdline(args ...string) string { return strings.Join(args, "\x00") + "\x00" }

func TestParseQEMUArgs(t *testing.T) {
	for _, tc := range []struct {
		name  string
		args  []string
		skip  string
		ok    bool
		cpus  int
		guest int64
	}{
		{"forkvm vm", []string{"qemu", "-name", "w1,process=forkvm-w1", "-smp", "2", "-m", "2048M"}, "", true, 2, 2 << 30},
		{"keyed forms", []string{"qemu", "-name", "a,process=forkvm-a", "-smp", "cpus=4,sockets=1", "-m", "size=1G"}, "", true, 4, 1 << 30},
		{"plain MiB, no -smp", []string{"qemu", "-name", "a,process=forkvm-a", "-m", "512"}, "", true, 1, 512 << 20},
		{"not forkvm's", []string{"qemu", "-name", "other", "-smp", "8", "-m", "8G"}, "", false, 0, 0},
		{"marker elsewhere", []string{"sh", "-c", "echo ,process=forkvm-x", "-smp", "8"}, "", false, 0, 0},
		{"own run dir skipped", []string{"qemu", "-name", "a,process=forkvm-a", "-chardev", "socket,id=qmp,path=/s/run/a/qmp.sock", "-smp", "2"}, "path=/s/run/", false, 0, 0},
		{"other run dir counted", []string{"qemu", "-name", "a,process=forkvm-a", "-chardev", "socket,id=qmp,path=/s/run2/a/qmp.sock", "-smp", "2", "-m", "256M"}, "path=/s/run/", true, 2, 256 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u, ok := parseQEMUArgs(tc.args, tc.skip)
			if ok != tc.ok || u.CPUs != tc.cpus || u.Guest != tc.guest {
				t.Errorf("parseQEMUArgs = %+v, %v; want cpus %d guest %d ok %v", u, ok, tc.cpus, tc.guest, tc.ok)
			}
		})
	}
}

func TestHostQEMUScan(t *testing.T) {
	h := fakeHost(t, 16<<30, 8<<30)
	admissiontest.WriteFiles(t, h.Proc, map[string]string{
		// another state directory's VM: counted, with its resident anonymous memory
		"101/cmdline": cmdline("qemu-system-x86_64", "-name", "w1,process=forkvm-w1", "-smp", "7", "-m", "2048M",
			"-chardev", "socket,id=qmp,path=/other/run/w1/qmp.sock,server=on"),
		"101/status": "Name:\tqemu\nRssAnon:\t   204800 kB\n",
		// this engine's own: counted by the engine itself
		"102/cmdline": cmdline("qemu-system-x86_64", "-name", "f1,process=forkvm-f1", "-smp", "2", "-m", "512M",
			"-chardev", "socket,id=qmp,path=/mine/run/f1/qmp.sock,server=on"),
		// an unrelated QEMU and a shell
		"103/cmdline":  cmdline("qemu-system-x86_64", "-name", "libvirt-vm", "-smp", "16"),
		"104/cmdline":  cmdline("bash"),
		"self/cmdline": cmdline("x"),
	})
	got := h.QEMUs("path=/mine/run/")
	if len(got) != 1 || got[0].PID != 101 || got[0].CPUs != 7 || got[0].Guest != 2<<30 || got[0].Private != 200<<20 {
		t.Fatalf("qemus = %+v, want pid 101, 7 vCPUs, 2 GiB, 200 MiB private", got)
	}
}

func TestMemCgroup(t *testing.T) {
	const gib = int64(1) << 30
	for _, tc := range []struct {
		name     string
		files    map[string]string
		version  int
		limit    int64
		headroom int64
	}{
		{"v1 nested: the parent's limit is tighter", map[string]string{
			"proc/self/cgroup":              "5:memory:/a/b\n4:cpu,cpuacct:/\n0::/\n",
			"proc/self/mountinfo":           "30 25 0:26 / @/mem rw,nosuid - cgroup cgroup rw,memory\n31 25 0:27 / @/unified rw - cgroup2 cgroup2 rw\n",
			"mem/memory.limit_in_bytes":     "9223372036854771712\n",
			"mem/memory.usage_in_bytes":     "10000000000\n",
			"mem/a/memory.limit_in_bytes":   fmt.Sprint(6 * gib),
			"mem/a/memory.usage_in_bytes":   fmt.Sprint(5 * gib),
			"mem/a/memory.stat":             fmt.Sprintf("cache 1\ntotal_inactive_file %d\n", gib/2),
			"mem/a/b/memory.limit_in_bytes": fmt.Sprint(8 * gib),
			"mem/a/b/memory.usage_in_bytes": fmt.Sprint(2 * gib),
		}, 1, 6 * gib, gib + gib/2},
		{"v1 leaf limit only", map[string]string{
			"proc/self/cgroup":            "4:memory:/t\n",
			"proc/self/mountinfo":         "30 25 0:26 / @/mem rw - cgroup cgroup rw,memory\n",
			"mem/memory.limit_in_bytes":   "9223372036854771712\n",
			"mem/t/memory.limit_in_bytes": fmt.Sprint(gib),
			"mem/t/memory.usage_in_bytes": fmt.Sprint(gib / 4),
		}, 1, gib, 3 * gib / 4},
		{"v2", map[string]string{
			"proc/self/cgroup":             "0::/svc/x\n",
			"proc/self/mountinfo":          "31 25 0:27 / @/unified rw - cgroup2 cgroup2 rw\n",
			"unified/svc/memory.max":       "max\n",
			"unified/svc/memory.current":   "5\n",
			"unified/svc/x/memory.max":     fmt.Sprint(2 * gib),
			"unified/svc/x/memory.current": fmt.Sprint(gib + gib/2),
			"unified/svc/x/memory.stat":    fmt.Sprintf("anon 1\ninactive_file %d\n", gib/2),
		}, 2, 2 * gib, gib},
		{"no limit anywhere", map[string]string{
			"proc/self/cgroup":          "4:memory:/\n",
			"proc/self/mountinfo":       "30 25 0:26 / @/mem rw - cgroup cgroup rw,memory\n",
			"mem/memory.limit_in_bytes": "9223372036854771712\n",
		}, 1, 0, 0},
		{"no memory controller", map[string]string{
			"proc/self/cgroup":    "0::/\n",
			"proc/self/mountinfo": "31 25 0:27 / @/unified rw - cgroup2 cgroup2 rw\n",
		}, 0, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			files := map[string]string{}
			for k, v := range tc.files {
				files[k] = strings.ReplaceAll(v, "@", dir)
			}
			admissiontest.WriteFiles(t, dir, files)
			h := Probe{Proc: filepath.Join(dir, "proc"), SelfCgroup: filepath.Join(dir, "proc/self/cgroup"), Mountinfo: filepath.Join(dir, "proc/self/mountinfo")}
			cg, err := h.memCgroup()
			if err != nil {
				t.Fatal(err)
			}
			if cg.limit != tc.limit || cg.headroom != tc.headroom || (tc.limit > 0 && cg.version != tc.version) {
				t.Errorf("memCgroup = %+v, want v%d limit %d headroom %d", cg, tc.version, tc.limit, tc.headroom)
			}
		})
	}
}

func TestCgroupMembership(t *testing.T) {
	cg := memCgroup{version: 1, mount: "/sys/fs/cgroup/memory", dir: "/sys/fs/cgroup/memory/jobs/a"}
	for _, tc := range []struct {
		name string
		u    QEMU
		want bool
	}{
		{"own VM", QEMU{}, true},
		{"same cgroup", QEMU{cgKnown: true, cgV1: "/jobs/a"}, true},
		{"below it", QEMU{cgKnown: true, cgV1: "/jobs/a/forkvm-x-vm"}, true},
		{"a sibling with the same prefix", QEMU{cgKnown: true, cgV1: "/jobs/ab"}, false},
		{"elsewhere", QEMU{cgKnown: true, cgV1: "/"}, false},
	} {
		if got := cg.in(tc.u); got != tc.want {
			t.Errorf("%s: in = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestMemoryArithmetic(t *testing.T) {
	const mib = int64(1) << 20
	vms := []QEMU{
		{Guest: 2048 * mib, Private: 30 * mib},   // a fresh fork: 64 + 204.8 − 30 still to come
		{Guest: 2048 * mib, Private: 1500 * mib}, // grew past its commitment: 0
	}
	if got, want := outstanding(vms, 0.1, nil), CommitBytes(2048*mib, 0.1)-30*mib; got != want {
		t.Errorf("outstanding = %d, want %d", got, want)
	}
	// A measured source: its forks owe its commitment less what they hold.
	measured := []QEMU{
		{Guest: 2048 * mib, Private: 10 * mib, Source: "ck:a"},
		{Guest: 2048 * mib, Private: 60 * mib, Source: "ck:a"}, // past it: 0
		{Guest: 2048 * mib, Private: 10 * mib, Source: "ck:b"}, // not measured: the prior
	}
	high := map[string]int64{"ck:a": 30 * mib}
	if got, want := outstanding(measured, 0.1, high), (30+16-10)*mib+CommitBytes(2048*mib, 0.1)-10*mib; got != want {
		t.Errorf("outstanding with a measured source = %d MiB, want %d MiB", got/mib, want/mib)
	}
	for _, tc := range []struct {
		name      string
		avail     int64
		cg        memCgroup
		committed int64
		inCgroup  int64
		want      int64
	}{
		{"no cgroup: MemAvailable", 10000 * mib, memCgroup{}, 1000 * mib, 1000 * mib, 10000*mib - 512*mib - 1000*mib},
		{"cgroup headroom lower", 20000 * mib, memCgroup{limit: 6144 * mib, headroom: 1000 * mib}, 0, 0, 1000*mib - 512*mib},
		{"MemAvailable lower", 800 * mib, memCgroup{limit: 6144 * mib, headroom: 5000 * mib}, 100 * mib, 100 * mib, 800*mib - 512*mib - 100*mib},
		{"VMs outside the cgroup leave its headroom", 20000 * mib, memCgroup{limit: 6144 * mib, headroom: 1000 * mib}, 5000 * mib, 100 * mib, 900*mib - 512*mib},
		{"over-committed: negative", 1000 * mib, memCgroup{}, 2000 * mib, 2000 * mib, 1000*mib - 512*mib - 2000*mib},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := memFree(tc.avail, tc.cg, 512*mib, tc.committed, tc.inCgroup); got != tc.want {
				t.Errorf("memFree = %d MiB, want %d MiB", got/mib, tc.want/mib)
			}
		})
	}
}

// TestMemoryPerCPUFree: the free pages on the kernel's per-CPU lists count as
// available; a zoneinfo that is missing or cannot be parsed leaves MemAvailable alone.
func TestMemoryPerCPUFree(t *testing.T) {
	const mib = int64(1) << 20
	page := int64(os.Getpagesize())
	for _, tc := range []struct {
		name     string
		zoneinfo string // "" = no file
		want     int64
	}{
		{"no zoneinfo", "", 4000 * mib},
		{"two CPUs' lists", "Node 0, zone   Normal\n  pages free 10\n  pagesets\n    cpu: 0\n              count:    100\n    cpu: 1\n              count:    28\n", 4000*mib + 128*page},
		{"malformed", "Node 0, zone   Normal\n  pagesets\n    cpu: 0\n              count:    many\n", 4000 * mib},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := fakeHost(t, 8000*mib, 4000*mib)
			if tc.zoneinfo != "" {
				admissiontest.WriteFiles(t, filepath.Dir(h.Proc), map[string]string{"proc/zoneinfo": tc.zoneinfo})
			}
			m := h.Memory(nil, 0, nil, 512*mib, 0.1)
			if !m.Known || m.AvailableBytes != tc.want || m.TotalBytes != 8000*mib {
				t.Fatalf("available %d, total %d (known %v); want %d, %d", m.AvailableBytes, m.TotalBytes, m.Known, tc.want, 8000*mib)
			}
			if m.FreeBytes != tc.want-512*mib {
				t.Errorf("free %d MiB, want %d MiB", m.FreeBytes/mib, (tc.want-512*mib)/mib)
			}
		})
	}
}
