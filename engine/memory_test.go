package engine

import (
	"testing"

	"github.com/forkvm/forkvm/procinfo"
)

func TestClassifyMemory(t *testing.T) {
	const k = 1 << 10
	const ram = "/dev/shm/forkvm-x/ck-a.ram"
	mapping := func(perms, path string, size, rss, anon int64) procinfo.Mapping {
		return procinfo.Mapping{Start: 1 << 30, End: 1<<30 + uint64(size), Perms: perms, Path: path, Rss: rss, Anonymous: anon}
	}
	qemu := []procinfo.Mapping{
		mapping("r-xp", "/usr/bin/qemu-system-x86_64", 6628*k, 6112*k, 0),       // shared code
		mapping("r--p", "/usr/bin/qemu-system-x86_64", 12208*k, 1632*k, 1632*k), // relocated
		mapping("rw-p", "/usr/lib/x86_64-linux-gnu/libglib-2.0.so.0", 8*k, 8*k, 4*k),
		mapping("rw-p", "[heap]", 16324*k, 5112*k, 5112*k),
		mapping("rwxp", "", 4092*k, 4092*k, 4092*k), // TCG regions
		mapping("rwxp", "", 4092*k, 2048*k, 2048*k),
		mapping("---p", "", 4*k, 0, 0), // guard page
		mapping("rw-p", "", 1296*k, 1284*k, 1284*k),
		mapping("rw-p", "[stack]", 132*k, 24*k, 24*k),
	}
	for _, tc := range []struct {
		name    string
		extra   []procinfo.Mapping
		ramPath string
		guest   int64
		want    MemoryUsage
	}{
		{
			name:    "fork: copy-on-write mapping of the checkpoint file",
			extra:   []procinfo.Mapping{mapping("rw-p", ram, 2<<30, 22592*k, 2508*k)},
			ramPath: ram + "/", // not clean: compared cleaned
			guest:   2 << 30,
			want: MemoryUsage{GuestWritten: 2508 * k, GuestFile: (22592 - 2508) * k, TCGCode: 6140 * k,
				Heap: (5112 + 1284 + 24) * k, Libraries: (1632 + 4) * k},
		},
		{
			name:    "forkable VM: shared RAM file, deleted while mapped",
			extra:   []procinfo.Mapping{mapping("rw-s", ram+" (deleted)", 2<<30, 300<<20, 0)},
			ramPath: ram,
			guest:   2 << 30,
			want: MemoryUsage{GuestFile: 300 << 20, TCGCode: 6140 * k,
				Heap: (5112 + 1284 + 24) * k, Libraries: (1632 + 4) * k},
		},
		{
			name:  "anonymous guest RAM (restore of a full save)",
			extra: []procinfo.Mapping{mapping("rw-p", "", 2<<30, 400<<20, 400<<20)},
			guest: 2 << 30,
			want: MemoryUsage{GuestWritten: 400 << 20, TCGCode: 6140 * k,
				Heap: (5112 + 1284 + 24) * k, Libraries: (1632 + 4) * k},
		},
		{
			name: "split-wx: TCG buffer in a memfd mapped twice",
			extra: []procinfo.Mapping{
				mapping("rw-s", "/memfd:tcg-jit (deleted)", 64<<20, 3<<20, 0),
				mapping("r-xs", "/memfd:tcg-jit (deleted)", 64<<20, 3<<20, 0),
				mapping("rw-p", ram, 2<<30, 8<<20, 1<<20),
			},
			ramPath: ram,
			guest:   2 << 30,
			want: MemoryUsage{GuestWritten: 1 << 20, GuestFile: 7 << 20, TCGCode: 6140*k + 3<<20,
				Heap: (5112 + 1284 + 24) * k, Libraries: (1632 + 4) * k},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ms := append(append([]procinfo.Mapping{}, qemu...), tc.extra...)
			got := classifyMemory(ms, tc.ramPath, tc.guest)
			want := tc.want
			want.Private = want.GuestWritten + want.TCGCode + want.Heap + want.Libraries
			var rss int64
			for _, m := range ms {
				rss += m.Rss
			}
			want.Rss = rss
			want.Shared = rss - want.Private
			if *got != want {
				t.Errorf("got  %+v\nwant %+v", *got, want)
			}
		})
	}
}
