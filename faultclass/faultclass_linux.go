//go:build linux

package faultclass

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
)

// classes is the number of counters per watched process.
const classes = numPhase * int(numRegion) * int(numAccess)

// Options size a Session's maps (fixed when it opens).
type Options struct {
	// MaxProcesses is how many processes the session can watch at once: an
	// unwatched one's place is kept (its counts stay readable) until Release frees
	// it. Default 256.
	MaxProcesses int
	// HolePages is how many pages of guest-RAM mappings the session can keep hole
	// bitmaps for at once (a bitmap is shared by the processes given the same holes
	// key, and freed when the last of them is released). Default 16 GiB of pages.
	HolePages int64
}

// target is the kernel's view of one watched process (the targets map's value).
type target struct {
	Start, End uint64 // the guest-RAM mapping (0, 0: none)
	HoleBase   uint32 // 1 + the first word of its hole bitmap in the holes map; 0: none
	Slot       uint32 // its counters start at Slot × classes
	Ready      uint32 // 1 after Ready
	_          uint32
}

// Session is an attached fault classifier. Its methods are safe for concurrent use.
type Session struct {
	prog                   *ebpf.Program
	lnk                    link.Link
	targets, holes, counts *ebpf.Map
	maxProcs, holeWords    int

	mu       sync.Mutex
	procs    map[int]target
	nextSlot int
	free     []uint32 // slots of released processes, for the next ones

	nextWord int
	bitmaps  map[string]*bitmap // by key (holes key, mapping offset and size)
	keys     map[int]string     // pid -> the key of the bitmap it uses
	freed    []words            // words of bitmaps no process uses, zeroed, for the next ones
}

// bitmap is a hole bitmap in the holes map and how many watched processes use it.
type bitmap struct {
	words
	users int
}

// words are n words of the holes map from first.
type words struct{ first, n int }

// Open loads the classifier and attaches it to the page_fault_user tracepoint. Its
// error wraps ErrUnavailable when this host or user cannot.
func Open(opts Options) (*Session, error) {
	if opts.MaxProcesses <= 0 {
		opts.MaxProcesses = 256
	}
	if opts.HolePages <= 0 {
		opts.HolePages = 16 << 30 / pageSize
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("%w: memlock limit: %w", ErrUnavailable, err)
	}
	s := &Session{maxProcs: opts.MaxProcesses, holeWords: int((opts.HolePages + 63) / 64),
		procs: map[int]target{}, bitmaps: map[string]*bitmap{}, keys: map[int]string{}}
	var err error
	if s.targets, err = ebpf.NewMap(&ebpf.MapSpec{Name: "fc_targets", Type: ebpf.Hash, KeySize: 4, ValueSize: 32, MaxEntries: uint32(s.maxProcs)}); err == nil {
		if s.holes, err = ebpf.NewMap(&ebpf.MapSpec{Name: "fc_holes", Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: uint32(max(s.holeWords, 1))}); err == nil {
			s.counts, err = ebpf.NewMap(&ebpf.MapSpec{Name: "fc_counts", Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 8, MaxEntries: uint32(s.maxProcs * classes)})
		}
	}
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("%w: bpf maps: %w", ErrUnavailable, err)
	}
	s.prog, err = ebpf.NewProgram(&ebpf.ProgramSpec{Name: "fc_fault", Type: ebpf.RawTracepoint, License: "GPL",
		Instructions: program(s.targets.FD(), s.holes.FD(), s.counts.FD())})
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("%w: load program: %w", ErrUnavailable, err)
	}
	if s.lnk, err = link.AttachRawTracepoint(link.RawTracepointOptions{Name: "page_fault_user", Program: s.prog}); err != nil {
		s.Close()
		return nil, fmt.Errorf("%w: attach to page_fault_user: %w", ErrUnavailable, err)
	}
	return s, nil
}

// program is the classifier. Its context is the raw tracepoint's arguments:
// page_fault_user(unsigned long address, struct pt_regs *regs, unsigned long
// error_code).
func program(targets, holes, counts int) asm.Instructions {
	const (
		rCtx    = asm.R6 // the context, then the access
		rTarget = asm.R7
		rAddr   = asm.R8 // the address, then its page in the mapping
		rErr    = asm.R9 // the error code, then the region
	)
	return asm.Instructions{
		asm.Mov.Reg(rCtx, asm.R1),
		asm.FnGetCurrentPidTgid.Call(),
		asm.RSh.Imm(asm.R0, 32), // the tgid: the process
		asm.StoreMem(asm.RFP, -4, asm.R0, asm.Word),
		asm.LoadMapPtr(asm.R1, targets),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "exit"),
		asm.Mov.Reg(rTarget, asm.R0),
		asm.LoadMem(rAddr, rCtx, 0, asm.DWord),
		asm.LoadMem(rErr, rCtx, 16, asm.DWord),
		// access = fetch ? 4 : (write ? 0 : 2) + present
		asm.Mov.Reg(rCtx, rErr),
		asm.RSh.Imm(rCtx, 1),
		asm.And.Imm(rCtx, 1),
		asm.Xor.Imm(rCtx, 1),
		asm.LSh.Imm(rCtx, 1),
		asm.Mov.Reg(asm.R1, rErr),
		asm.And.Imm(asm.R1, 1),
		asm.Add.Reg(rCtx, asm.R1),
		asm.Mov.Reg(asm.R1, rErr),
		asm.And.Imm(asm.R1, 0x10),
		asm.JEq.Imm(asm.R1, 0, "region"),
		asm.Mov.Imm(rCtx, int32(Fetch)),
		// region: Other outside [Start, End), else RAMHole when the page's bit is set
		asm.Mov.Imm(rErr, int32(Other)).WithSymbol("region"),
		asm.LoadMem(asm.R1, rTarget, 0, asm.DWord),
		asm.LoadMem(asm.R2, rTarget, 8, asm.DWord),
		asm.JLT.Reg(rAddr, asm.R1, "count"),
		asm.JGE.Reg(rAddr, asm.R2, "count"),
		asm.Mov.Imm(rErr, int32(RAMData)),
		asm.Sub.Reg(rAddr, asm.R1),
		asm.RSh.Imm(rAddr, 12),
		asm.LoadMem(asm.R1, rTarget, 16, asm.Word),
		asm.JEq.Imm(asm.R1, 0, "count"),
		asm.Add.Imm(asm.R1, -1),
		asm.Mov.Reg(asm.R2, rAddr),
		asm.RSh.Imm(asm.R2, 6),
		asm.Add.Reg(asm.R2, asm.R1),
		asm.StoreMem(asm.RFP, -8, asm.R2, asm.Word),
		asm.LoadMapPtr(asm.R1, holes),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -8),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "count"),
		asm.LoadMem(asm.R0, asm.R0, 0, asm.DWord),
		asm.And.Imm(rAddr, 63),
		asm.RSh.Reg(asm.R0, rAddr),
		asm.And.Imm(asm.R0, 1),
		asm.JEq.Imm(asm.R0, 0, "count"),
		asm.Mov.Imm(rErr, int32(RAMHole)),
		// index = ((slot × 2 + ready) × regions + region) × accesses + access
		asm.LoadMem(asm.R1, rTarget, 20, asm.Word).WithSymbol("count"),
		asm.Mul.Imm(asm.R1, numPhase),
		asm.LoadMem(asm.R2, rTarget, 24, asm.Word),
		asm.Add.Reg(asm.R1, asm.R2),
		asm.Mul.Imm(asm.R1, int32(numRegion)),
		asm.Add.Reg(asm.R1, rErr),
		asm.Mul.Imm(asm.R1, int32(numAccess)),
		asm.Add.Reg(asm.R1, rCtx),
		asm.StoreMem(asm.RFP, -12, asm.R1, asm.Word),
		asm.LoadMapPtr(asm.R1, counts),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -12),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "exit"),
		asm.LoadMem(asm.R1, asm.R0, 0, asm.DWord),
		asm.Add.Imm(asm.R1, 1),
		asm.StoreMem(asm.R0, 0, asm.R1, asm.DWord), // a per-CPU counter: no other writer
		asm.Mov.Imm(asm.R0, 0).WithSymbol("exit"),
		asm.Return(),
	}
}

// Watch starts counting pid's faults. ram is its guest-RAM mapping (zero: none yet,
// every fault is Other until SetRAM) and holes the hole ranges of the file it maps,
// shared by every process given the same holesKey (the hole list's path; "": none).
func (s *Session) Watch(pid int, ram Mapping, holesKey string, holes []Range) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.targets == nil {
		return fmt.Errorf("faultclass: watch: %w", os.ErrClosed)
	}
	t, ok := s.procs[pid]
	if !ok {
		slot, err := s.takeSlot()
		if err != nil {
			return err
		}
		t = target{Slot: slot}
	}
	if err := s.setRAM(pid, t, ram, holesKey, holes); err != nil {
		if !ok {
			s.free = append(s.free, t.Slot)
		}
		return err
	}
	return nil
}

// takeSlot is a slot for a new process: a released one (its counters zeroed), else the
// next unused; s.mu is held.
func (s *Session) takeSlot() (uint32, error) {
	if n := len(s.free); n > 0 {
		slot := s.free[n-1]
		zero := make([]uint64, ebpf.MustPossibleCPU())
		for i := range classes {
			if err := s.counts.Update(uint32(int(slot)*classes+i), zero, ebpf.UpdateAny); err != nil {
				return 0, fmt.Errorf("faultclass: reuse a slot: %w", err)
			}
		}
		s.free = s.free[:n-1]
		return slot, nil
	}
	if s.nextSlot >= s.maxProcs {
		return 0, fmt.Errorf("%w: %d processes watched", ErrFull, s.maxProcs)
	}
	s.nextSlot++
	return uint32(s.nextSlot - 1), nil
}

// SetRAM sets the guest-RAM mapping and holes of a watched process (one watched
// before QEMU mapped its RAM), as Watch does.
func (s *Session) SetRAM(pid int, ram Mapping, holesKey string, holes []Range) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.procs[pid]
	if !ok || s.targets == nil {
		return fmt.Errorf("%w: %d", ErrNotWatched, pid)
	}
	return s.setRAM(pid, t, ram, holesKey, holes)
}

// setRAM writes t with ram and its hole bitmap for pid; s.mu is held. The bitmap pid
// used before, if another, is given up.
func (s *Session) setRAM(pid int, t target, ram Mapping, holesKey string, holes []Range) error {
	t.Start, t.End, t.HoleBase = ram.Start, ram.End, 0
	key := ""
	if holesKey != "" && ram.End > ram.Start {
		key = fmt.Sprintf("%s@%d+%d", holesKey, ram.Offset, ram.End-ram.Start)
		b, ok := s.bitmaps[key]
		if !ok {
			bm := holeBitmap(ram, holes)
			at, err := s.takeWords(len(bm))
			if err != nil {
				return err
			}
			b = &bitmap{words: at}
			s.bitmaps[key] = b
			for i, w := range bm {
				if w == 0 {
					continue
				}
				if err := s.holes.Update(uint32(at.first+i), w, ebpf.UpdateAny); err != nil {
					s.unuse(key)
					return fmt.Errorf("faultclass: hole bitmap: %w", err)
				}
			}
		}
		t.HoleBase = uint32(b.first) + 1
		b.users++
	}
	if err := s.targets.Update(uint32(pid), &t, ebpf.UpdateAny); err != nil {
		s.unuse(key)
		return fmt.Errorf("faultclass: watch %d: %w", pid, err)
	}
	s.procs[pid] = t
	s.unuse(s.keys[pid])
	s.keys[pid] = key
	return nil
}

// takeWords finds n zeroed words of the holes map: freed ones where they fit, else
// never used ones; s.mu is held.
func (s *Session) takeWords(n int) (words, error) {
	for i, f := range s.freed {
		if f.n < n {
			continue
		}
		if f.n == n {
			s.freed = append(s.freed[:i], s.freed[i+1:]...)
		} else {
			s.freed[i] = words{f.first + n, f.n - n}
		}
		return words{f.first, n}, nil
	}
	if s.nextWord+n > s.holeWords {
		return words{}, fmt.Errorf("%w: hole bitmaps of %d pages", ErrFull, s.holeWords*64)
	}
	s.nextWord += n
	return words{s.nextWord - n, n}, nil
}

// unuse gives up one use of the bitmap of key ("": none) and frees its words, zeroed,
// when it was the last; s.mu is held. Words that cannot be zeroed are not used again.
func (s *Session) unuse(key string) {
	b, ok := s.bitmaps[key]
	if !ok {
		return
	}
	if b.users--; b.users > 0 {
		return
	}
	delete(s.bitmaps, key)
	for i := range b.n {
		if err := s.holes.Update(uint32(b.first+i), uint64(0), ebpf.UpdateAny); err != nil {
			return
		}
	}
	s.freed = append(s.freed, b.words)
}

// Ready counts pid's later faults as after ready. After Close it fails wrapping
// os.ErrClosed, as Watch and Counts do.
func (s *Session) Ready(pid int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.targets == nil {
		return fmt.Errorf("faultclass: ready: %w", os.ErrClosed)
	}
	t, ok := s.procs[pid]
	if !ok {
		return fmt.Errorf("%w: %d", ErrNotWatched, pid)
	}
	t.Ready = 1
	if err := s.targets.Update(uint32(pid), &t, ebpf.UpdateExist); err != nil {
		return fmt.Errorf("faultclass: %d: %w", pid, err)
	}
	s.procs[pid] = t
	return nil
}

// Counts returns pid's faults so far (summed over CPUs). It holds s.mu while it reads
// the counters: Close (a daemon's shutdown while a fork's agent phase ends) must not
// free the map under it.
func (s *Session) Counts(pid int) (Counts, error) {
	var c Counts
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.counts == nil {
		return c, fmt.Errorf("faultclass: counts: %w", os.ErrClosed)
	}
	t, ok := s.procs[pid]
	if !ok {
		return c, fmt.Errorf("%w: %d", ErrNotWatched, pid)
	}
	var per []uint64
	for i := range classes {
		if err := s.counts.Lookup(uint32(int(t.Slot)*classes+i), &per); err != nil {
			return c, fmt.Errorf("faultclass: counts of %d: %w", pid, err)
		}
		var sum uint64
		for _, v := range per {
			sum += v
		}
		c[i/(int(numRegion)*int(numAccess))][(i/int(numAccess))%int(numRegion)][i%int(numAccess)] = sum
	}
	return c, nil
}

// Unwatch stops counting pid (its counts stay readable).
func (s *Session) Unwatch(pid int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.procs[pid]; ok && s.targets != nil {
		_ = s.targets.Delete(uint32(pid))
	}
}

// Release stops counting pid and frees its place for another process (Options
// MaxProcesses bounds the processes watched at once, not over the session's life):
// its counts are gone. A long-lived session (forkvm serve --faults) releases each
// process once it read its counts.
func (s *Session) Release(pid int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.procs[pid]
	if !ok {
		return
	}
	if s.targets != nil {
		_ = s.targets.Delete(uint32(pid))
		s.unuse(s.keys[pid])
	}
	delete(s.procs, pid)
	delete(s.keys, pid)
	s.free = append(s.free, t.Slot)
}

// Close detaches the program and frees its maps.
func (s *Session) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	if s.lnk != nil {
		errs = append(errs, s.lnk.Close())
	}
	if s.prog != nil {
		errs = append(errs, s.prog.Close())
	}
	for _, m := range []*ebpf.Map{s.targets, s.holes, s.counts} {
		if m != nil {
			errs = append(errs, m.Close())
		}
	}
	s.lnk, s.prog, s.targets, s.holes, s.counts = nil, nil, nil, nil, nil
	return errors.Join(errs...)
}

// RAMMappingIn finds the largest mapping pid has of a file directly in dir (the
// engine's RAM directory: a fork's checkpoint RAM file), and the file.
func RAMMappingIn(pid int, dir string) (Mapping, string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return Mapping{}, "", fmt.Errorf("faultclass: %w", err)
	}
	m, file, ok := findMappingIn(b, dir)
	if !ok {
		return Mapping{}, "", fmt.Errorf("faultclass: pid %d maps no file in %s", pid, dir)
	}
	return m, file, nil
}

// RAMMapping finds where pid maps file (its guest RAM) in /proc/PID/maps.
func RAMMapping(pid int, file string) (Mapping, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return Mapping{}, fmt.Errorf("faultclass: %w", err)
	}
	m, ok := findMapping(b, file)
	if !ok {
		return Mapping{}, fmt.Errorf("faultclass: pid %d does not map %s", pid, file)
	}
	return m, nil
}
