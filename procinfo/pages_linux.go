package procinfo

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// kpages reads /proc/kpagecount and /proc/kpageflags.
type kpages struct{ cnt, flg *os.File }

func openKPages() (*kpages, error) {
	cnt, err := os.Open("/proc/kpagecount")
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrPagesUnavailable, err)
	}
	flg, err := os.Open("/proc/kpageflags")
	if err != nil {
		cnt.Close()
		return nil, fmt.Errorf("%w: %w", ErrPagesUnavailable, err)
	}
	return &kpages{cnt, flg}, nil
}

func (k *kpages) close() { k.cnt.Close(); k.flg.Close() }

func read8(f *os.File, pfn uint64) (uint64, error) {
	var b [8]byte
	if _, err := f.ReadAt(b[:], int64(pfn*8)); err != nil {
		return 0, fmt.Errorf("%s: pfn %#x: %w", f.Name(), pfn, err)
	}
	return binary.LittleEndian.Uint64(b[:]), nil
}

func (k *kpages) count(pfn uint64) (uint64, error) { return read8(k.cnt, pfn) }
func (k *kpages) flags(pfn uint64) (uint64, error) { return read8(k.flg, pfn) }

// Pages reads the census of the file-backed mapping of process pid that is exactly
// memBytes long (a QEMU's guest RAM), naming it name. It needs root: pagemap hides page
// frame numbers from others, and /proc/kpagecount is root's (ErrPagesUnavailable).
func Pages(name string, pid int, memBytes int64) (*PageCensus, error) {
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("%w: needs root (pagemap hides page frame numbers from others, /proc/kpagecount is root's)", ErrPagesUnavailable)
	}
	start, end, file, err := ramMapping(pid, memBytes)
	if err != nil {
		return nil, err
	}
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return nil, fmt.Errorf("procinfo: %s: %w", name, err)
	}
	defer pm.Close()
	pg := uint64(os.Getpagesize())
	n := (end - start) / pg
	buf := make([]byte, n*8)
	if _, err := pm.ReadAt(buf, int64(start/pg*8)); err != nil {
		return nil, fmt.Errorf("procinfo: %s: pagemap: %w", name, err)
	}
	entries := make([]uint64, n)
	for i := range entries {
		entries[i] = binary.LittleEndian.Uint64(buf[i*8:])
	}
	k, err := openKPages()
	if err != nil {
		return nil, err
	}
	defer k.close()
	c := &PageCensus{Name: name, PID: pid, Mapping: file}
	if err := classify(c, entries, k); err != nil {
		return nil, err
	}
	return c, nil
}

// ramMapping finds the guest RAM in /proc/PID/maps: the file-backed mapping exactly
// memBytes long.
func ramMapping(pid int, memBytes int64) (start, end uint64, file string, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return 0, 0, "", fmt.Errorf("procinfo: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fl := strings.Fields(sc.Text())
		if len(fl) < 6 || !strings.HasPrefix(fl[5], "/") {
			continue
		}
		a, b, ok := strings.Cut(fl[0], "-")
		if !ok {
			continue
		}
		s, err1 := strconv.ParseUint(a, 16, 64)
		e, err2 := strconv.ParseUint(b, 16, 64)
		if err1 == nil && err2 == nil && int64(e-s) == memBytes {
			return s, e, strings.Join(fl[5:], " "), nil
		}
	}
	return 0, 0, "", fmt.Errorf("procinfo: pid %d: no file mapping of %d bytes (guest RAM not file-backed?)", pid, memBytes)
}
