package admission

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/procinfo"
)

// qemuMarker is in the -name argument of every QEMU a forkvm engine starts (its process
// title, "process=forkvm-NAME"): the host-wide budget finds every forkvm QEMU on the
// host by it, whichever state directory started it.
const qemuMarker = ",process=forkvm-"

// QEMU is one forkvm QEMU process as the budget counts it.
type QEMU struct {
	PID   int
	CPUs  int
	Guest int64 // guest RAM, bytes (-m)
	// Private is the process's resident anonymous memory (RssAnon): what it already
	// added to the host (guest pages written by a fork, TCG buffers, heap); for a world
	// (shared RAM file) also its resident shared memory (RssShmem: its guest's pages).
	Private int64
	// Shared is set for a world: guest RAM in a file mapped share=on.
	Shared bool
	// Source is what its footprint is a sample of (Footprints; "" unknown), and Sample
	// whether it counts as one (a registered fork of this engine).
	Source string
	Sample bool
	// Ready is when a sample became ready (zero: unknown).
	Ready time.Time
	// cgV1 and cgV2 are the memory cgroup it runs in (cgroup v1's memory controller and
	// v2's path, from /proc/PID/cgroup) for another engine's QEMU; cgKnown is false for
	// this engine's own (its children: in its cgroup) and where they cannot be read.
	cgV1, cgV2 string
	cgKnown    bool
}

// Probe reads what admission counts from the host. Its paths are the real /proc
// files in an engine and fake trees in tests.
type Probe struct {
	Proc string // the proc file system ("/proc")
	// SelfCgroup and Mountinfo locate the memory cgroup the engine runs in
	// ("/proc/self/cgroup", "/proc/self/mountinfo").
	SelfCgroup, Mountinfo string
}

// Real is the probe of the host the engine runs on.
var Real = Probe{Proc: "/proc", SelfCgroup: "/proc/self/cgroup", Mountinfo: "/proc/self/mountinfo"}

// QEMUs returns the forkvm QEMU processes on the host whose argv contains no argument
// containing skip (the engine's own run directory: those it counts itself).
func (h Probe) QEMUs(skip string) []QEMU {
	pids, err := procinfo.ProcessesWithArgAt(h.Proc, qemuMarker)
	if err != nil {
		return nil
	}
	var out []QEMU
	for _, pid := range pids {
		b, err := os.ReadFile(filepath.Join(h.Proc, strconv.Itoa(pid), "cmdline"))
		if err != nil {
			continue // gone
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		u, ok := parseQEMUArgs(args, skip)
		if !ok {
			continue
		}
		u.PID = pid
		u.cgV1, u.cgV2, u.cgKnown = h.procCgroups(pid)
		u.Private = h.RSSAnon(pid)
		if u.Shared {
			u.Private += h.RSSShmem(pid)
		}
		out = append(out, u)
	}
	return out
}

// parseQEMUArgs reads the vCPUs (-smp) and guest RAM (-m) of a forkvm QEMU's argv.
// ok is false for a process that is not a forkvm QEMU (no -name with the marker) or
// that has an argument containing skip (skip "" skips nothing).
func parseQEMUArgs(args []string, skip string) (u QEMU, ok bool) {
	marked := false
	for i, a := range args {
		if skip != "" && strings.Contains(a, skip) {
			return QEMU{}, false
		}
		if i+1 >= len(args) {
			continue
		}
		v := args[i+1]
		switch a {
		case "-name":
			marked = marked || strings.Contains(v, qemuMarker)
		case "-object":
			var obj struct {
				Type  string `json:"qom-type"`
				Share bool   `json:"share"`
			}
			if json.Unmarshal([]byte(v), &obj) == nil && obj.Type == "memory-backend-file" {
				u.Shared = obj.Share
			}
		case "-smp":
			u.CPUs = optNumber(v, "cpus")
		case "-m":
			s := v
			if !strings.ContainsAny(s[:min(1, len(s))], "0123456789") {
				s = optValue(v, "size")
			}
			u.Guest = parseQEMUSize(s)
		}
	}
	if !marked {
		return QEMU{}, false
	}
	u.CPUs = max(u.CPUs, 1) // QEMU's default
	return u, true
}

// optNumber is the leading number of a QEMU option string ("2", "cpus=2,sockets=1").
func optNumber(v, key string) int {
	s := v
	if s != "" && (s[0] < '0' || s[0] > '9') {
		s = optValue(v, key)
	}
	s, _, _ = strings.Cut(s, ",")
	n, _ := strconv.Atoi(s)
	return n
}

// optValue is key's value in a QEMU option string "a=1,key=v".
func optValue(v, key string) string {
	for _, kv := range strings.Split(v, ",") {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			return val
		}
	}
	return ""
}

// parseQEMUSize parses a QEMU size ("2048M", "2G", "512": MiB by default, as -m has it).
func parseQEMUSize(s string) int64 {
	s, _, _ = strings.Cut(s, ",")
	if s == "" {
		return 0
	}
	mult := int64(1 << 20)
	switch s[len(s)-1] {
	case 'k', 'K':
		mult, s = 1<<10, s[:len(s)-1]
	case 'm', 'M':
		s = s[:len(s)-1]
	case 'g', 'G':
		mult, s = 1<<30, s[:len(s)-1]
	case 't', 'T':
		mult, s = 1<<40, s[:len(s)-1]
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0
	}
	return n * mult
}

// RSSAnon is a process's RssAnon (0 when it cannot be read).
func (h Probe) RSSAnon(pid int) int64 {
	v, _ := kbField(filepath.Join(h.Proc, strconv.Itoa(pid), "status"), "RssAnon")
	return v
}

// procCgroups reads the memory cgroup of process pid: its v1 memory controller's path
// and its v2 path; ok is false when /proc/PID/cgroup cannot be read.
func (h Probe) procCgroups(pid int) (v1, v2 string, ok bool) {
	b, err := os.ReadFile(filepath.Join(h.Proc, strconv.Itoa(pid), "cgroup"))
	if err != nil {
		return "", "", false
	}
	v1, v2, _, _ = parseProcCgroup(b)
	return v1, v2, true
}

// parseProcCgroup reads a /proc/PID/cgroup file: the memory controller's v1 path and
// the v2 path, and whether each is there.
func parseProcCgroup(b []byte) (v1, v2 string, haveV1, haveV2 bool) {
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			v2, haveV2 = parts[2], true
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == "memory" {
				v1, haveV1 = parts[2], true
			}
		}
	}
	return v1, v2, haveV1, haveV2
}

// RSSShmem is a process's RssShmem (0 when it cannot be read).
func (h Probe) RSSShmem(pid int) int64 {
	v, _ := kbField(filepath.Join(h.Proc, strconv.Itoa(pid), "status"), "RssShmem")
	return v
}

// meminfo returns the available memory and MemTotal: MemAvailable plus the free pages
// on the kernel's per-CPU lists (procinfo.ParsePerCPUFree), which MemAvailable leaves
// out though the allocator drains them before it reclaims: since Linux 6.7 they grow
// with the rate of frees, to an eighth of a zone, so a host that just deleted VMs
// would otherwise refuse forks for memory it has. Where zoneinfo cannot be read or
// parsed, MemAvailable alone (the smaller figure) is used.
func (h Probe) meminfo() (avail, total int64, err error) {
	p := filepath.Join(h.Proc, "meminfo")
	if avail, err = kbField(p, "MemAvailable"); err != nil {
		return 0, 0, err
	}
	if total, err = kbField(p, "MemTotal"); err != nil {
		return 0, 0, err
	}
	if b, err := os.ReadFile(filepath.Join(h.Proc, "zoneinfo")); err == nil {
		if pages, err := procinfo.ParsePerCPUFree(b); err == nil {
			avail += pages * int64(os.Getpagesize())
		}
	}
	return avail, total, nil
}

// kbField reads a "Name:   123 kB" line of a /proc file, in bytes.
func kbField(path, name string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		k, v, ok := bytes.Cut(line, []byte(":"))
		if !ok || string(k) != name {
			continue
		}
		f := strings.Fields(string(v))
		if len(f) == 0 {
			break
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %s: %w", path, name, err)
		}
		return n << 10, nil
	}
	return 0, fmt.Errorf("%s: no %s", path, name)
}

// memCgroup is the memory cgroup the engine runs in, as admission counts it.
type memCgroup struct {
	version int    // 1 or 2; 0: none found (no limit)
	dir     string // the cgroup's directory
	mount   string // its hierarchy's mount point
	// limit is the tightest limit on the way to the hierarchy's root (0: none), and
	// headroom what that limit still leaves: min over the cgroup and its ancestors of
	// limit − (usage − inactive file pages, which reclaim frees first).
	limit, headroom int64
}

// unlimited is what cgroup v1 reports as no limit (a page-rounded 2^63-1) and above.
const unlimited = math.MaxInt64 / 2

// memCgroup finds the engine's memory cgroup: cgroup v1's memory controller or v2's
// unified hierarchy, from /proc/self/cgroup and the mount table.
func (h Probe) memCgroup() (memCgroup, error) {
	b, err := os.ReadFile(h.SelfCgroup)
	if err != nil {
		return memCgroup{}, err
	}
	v1, v2, haveV1, haveV2 := parseProcCgroup(b)
	m1, m2, err := h.cgroupMounts()
	if err != nil {
		return memCgroup{}, err
	}
	switch {
	case haveV1 && m1 != "":
		return walkCgroup(1, m1, v1)
	case haveV2 && m2 != "":
		if _, err := os.Stat(filepath.Join(m2, v2, "memory.max")); err == nil || v2 == "/" {
			return walkCgroup(2, m2, v2)
		}
	}
	return memCgroup{}, nil
}

// cgroupMounts returns the mount points of cgroup v1's memory controller and of the
// cgroup v2 hierarchy ("" when not mounted).
func (h Probe) cgroupMounts() (v1, v2 string, err error) {
	f, err := os.Open(h.Mountinfo)
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// id parent major:minor root mountpoint options [optional...] - fstype source superopts
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 1 {
			continue
		}
		mnt := platform.UnescapeMount(pf[4])
		switch qf[0] {
		case "cgroup2":
			if v2 == "" {
				v2 = mnt
			}
		case "cgroup":
			if len(qf) >= 3 && v1 == "" {
				for _, o := range strings.Split(qf[2], ",") {
					if o == "memory" {
						v1 = mnt
					}
				}
			}
		}
	}
	return v1, v2, sc.Err()
}

// walkCgroup reads the limit and headroom of the cgroup at mount+rel and its ancestors.
func walkCgroup(version int, mount, rel string) (memCgroup, error) {
	limitFile, usageFile, inactive := "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
	if version == 2 {
		limitFile, usageFile, inactive = "memory.max", "memory.current", "inactive_file"
	}
	cg := memCgroup{version: version, mount: mount, dir: filepath.Join(mount, filepath.Clean("/"+rel))}
	for dir := cg.dir; ; dir = filepath.Dir(dir) {
		if lim, ok := readLimit(filepath.Join(dir, limitFile)); ok && lim < unlimited {
			usage, err := readInt(filepath.Join(dir, usageFile))
			if err != nil {
				return memCgroup{}, err
			}
			usage -= statField(filepath.Join(dir, "memory.stat"), inactive)
			if room := lim - max(usage, 0); cg.limit == 0 || room < cg.headroom {
				cg.headroom = room
			}
			if cg.limit == 0 || lim < cg.limit {
				cg.limit = lim
			}
		}
		if dir == mount || len(dir) <= len(mount) {
			break
		}
	}
	return cg, nil
}

// readLimit reads a limit file ("max" in v2: no limit).
func readLimit(path string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return math.MaxInt64, true
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// statField reads "name N" from a memory.stat-like file (0 when missing).
func statField(path, name string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == name {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// oomKills is the count of OOM kills in the cgroup at dir (v1 memory.oom_control's
// oom_kill, v2 memory.events' oom_kill; version 0: the kernel's, /proc/vmstat); ok is
// false when it cannot be read.
func oomKills(version int, dir string) (n int64, ok bool) {
	path := filepath.Join(dir, "memory.oom_control")
	switch version {
	case 0: // no memory cgroup: the kernel's count
		path = "/proc/vmstat"
	case 2:
		path = filepath.Join(dir, "memory.events")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, found := strings.Cut(line, " "); found && k == "oom_kill" {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// ForkOverhead is the prior's part for QEMU (see footprints): the host memory one
// VM is expected to add before its guest writes much, QEMU heap plus TCG buffers,
// rounded up well past what a fresh fork holds, so that an unmeasured source errs
// towards refusing a fork rather than overcommitting the host.
const ForkOverhead = 64 << 20

// Memory is the memory budget given every forkvm QEMU on the host (vms), pending (the
// commitments of admitted VMs not yet running), the footprint marks (high), the reserve
// kept free and the prior's commit ratio of guest RAM.
func (h Probe) Memory(vms []QEMU, pending int64, high map[string]int64, reserve int64, ratio float64) api.MemoryBudget {
	avail, total, err := h.meminfo()
	if err != nil {
		return api.MemoryBudget{}
	}
	m := api.MemoryBudget{Known: true, AvailableBytes: avail, TotalBytes: total, ReserveBytes: reserve, ForkOverheadBytes: ForkOverhead,
		CommitRatio: ratio, CommittedBytes: outstanding(vms, ratio, high) + pending,
		Basis: api.MemoryBasisFootprint, PressureLimit: PSISomeLimit}
	cg, err := h.memCgroup()
	inCgroup := m.CommittedBytes
	if err == nil && cg.limit > 0 {
		m.CgroupLimitBytes, m.CgroupHeadroomBytes = cg.limit, cg.headroom
		m.TotalBytes = min(m.TotalBytes, cg.limit)
		var in []QEMU
		for _, v := range vms {
			if cg.in(v) {
				in = append(in, v)
			}
		}
		inCgroup = outstanding(in, ratio, high) + pending
		m.CgroupCommittedBytes = inCgroup
	}
	m.FreeBytes = memFree(avail, cg, reserve, m.CommittedBytes, inCgroup)
	m.PressureSomeAvg10, m.PressureFullAvg10, m.PressureKnown = h.pressure(cg)
	counts := map[string]int{}
	for _, v := range vms {
		if v.Source != "" {
			counts[v.Source]++
		}
	}
	m.Sources = sourceFootprints(high, counts)
	return m
}

// CommitBytes is the prior: the host memory a VM of guest bytes is expected to take at
// most when nothing like it was measured (see Footprints): QEMU's own (heap, TCG
// buffers) plus ratio of its guest RAM (pages its guest may write).
func CommitBytes(guest int64, ratio float64) int64 {
	return api.MemoryBudget{ForkOverheadBytes: ForkOverhead, CommitRatio: ratio}.CommitBytes(guest)
}

// CommitFor is what a VM of source and guest bytes commits: its source's measured
// footprint (high: the marks of Footprints.Update), else the prior.
func CommitFor(source string, guest int64, ratio float64, high map[string]int64) int64 {
	if hw, ok := high[source]; ok && source != "" {
		return FootprintCommit(hw)
	}
	return CommitBytes(guest, ratio)
}

// outstanding is the growth still expected of running VMs: each VM's commitment minus
// what it already took (its RssAnon, already out of MemAvailable), never below zero.
func outstanding(vms []QEMU, ratio float64, high map[string]int64) int64 {
	var n int64
	for _, v := range vms {
		n += max(CommitFor(v.Source, v.Guest, ratio, high)-v.Private, 0)
	}
	return n
}

// memFree is the memory a new VM may commit: the smaller of MemAvailable less what
// every VM (committed) and the cgroup's headroom less what the VMs in it (inCgroup) are
// still expected to grow by (and the admitted VMs not yet running, in both), less the
// reserve.
func memFree(avail int64, cg memCgroup, reserve, committed, inCgroup int64) int64 {
	room := avail - committed
	if cg.limit > 0 {
		room = min(room, cg.headroom-inCgroup)
	}
	return room - reserve
}

// in reports whether VM u is charged to cgroup cg (or below it): this engine's own VMs
// and those whose cgroup cannot be read count as in it.
func (cg memCgroup) in(u QEMU) bool {
	if !u.cgKnown || cg.version == 0 {
		return true
	}
	rel := u.cgV1
	if cg.version == 2 {
		rel = u.cgV2
	}
	dir := filepath.Join(cg.mount, filepath.Clean("/"+rel))
	return dir == cg.dir || strings.HasPrefix(dir, cg.dir+"/")
}
