package engine

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
)

// TestProtectorLock: the points of one VM are taken one at a time, those of two VMs
// at once, and a VM's entry is gone once no one holds or waits for it (a host that
// protects thousands of short-lived forks must not keep one per name).
func TestProtectorLock(t *testing.T) {
	p := newProtector()
	var in [2]atomic.Int32
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := []string{"a", "b"}[i%2]
			unlock := p.lock(name)
			if n := in[i%2].Add(1); n != 1 {
				t.Errorf("%d holders of %s's lock", n, name)
			}
			runtime.Gosched()
			in[i%2].Add(-1)
			unlock()
		}()
	}
	wg.Wait()
	if len(p.busy) != 0 {
		t.Errorf("busy keeps %d entries after every lock was released", len(p.busy))
	}
}
