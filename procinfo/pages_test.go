package procinfo

import (
	"errors"
	"reflect"
	"testing"
)

// fakePages is kpagecount and kpageflags by pfn.
type fakePages struct{ counts, flagsOf map[uint64]uint64 }

func (f fakePages) count(pfn uint64) (uint64, error) {
	n, ok := f.counts[pfn]
	if !ok {
		return 0, errors.New("no such pfn")
	}
	return n, nil
}
func (f fakePages) flags(pfn uint64) (uint64, error) { return f.flagsOf[pfn], nil }

func TestClassifyPages(t *testing.T) {
	src := fakePages{counts: map[uint64]uint64{10: 1, 11: 3, 12: 3, 13: 9}, flagsOf: map[uint64]uint64{50: kpfZero}}
	entries := []uint64{
		0,                                   // never touched
		pmSwapped,                           // swapped
		pmPresent | pmFileOrSh | 10,         // file page, this process only
		pmPresent | pmFileOrSh | 11,         // file page, 2 siblings
		pmPresent | pmFileOrSh | 12,         // file page, 2 siblings
		pmPresent | pmFileOrSh | 13,         // file page, 8 siblings
		pmPresent | 20,                      // private copy
		pmPresent | 21,                      // private copy
		pmPresent | 50,                      // the zero page
		pmPresent | pmFileOrSh | 1<<55 | 10, // soft-dirty bit (55) is not part of the pfn
	}
	c := &PageCensus{}
	if err := classify(c, entries, src); err != nil {
		t.Fatal(err)
	}
	want := &PageCensus{Pages: 10, NotPresent: 1, Swapped: 1, Shared: 5, Copied: 2, Zero: 1,
		SharedBySiblings: map[int]int64{0: 2, 2: 2, 8: 1}}
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("census %+v\nwant   %+v", c, want)
	}
	// Page frame numbers read as zero: not root.
	if err := classify(&PageCensus{}, []uint64{pmPresent}, src); !errors.Is(err, ErrPagesUnavailable) {
		t.Errorf("pfn 0: %v, want ErrPagesUnavailable", err)
	}
	if err := classify(&PageCensus{}, []uint64{pmPresent | pmFileOrSh | 77}, src); err == nil {
		t.Error("unreadable kpagecount entry: no error")
	}
}
