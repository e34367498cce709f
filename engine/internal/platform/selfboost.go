package platform

import "sync"

// SelfBoost raises this process's own threads (boostSelf: real-time, below the paused
// guest's QEMU) while at least one holder needs it. A guest's pause waits on the
// engine's goroutines as much as on the guest's QEMU (the monitor's replies are read,
// and the guest's pages copied, by the engine), and on a host whose CPUs the other
// guests keep busy a nice-0 engine waits behind their vCPU threads at every step.
// Pauses of several VMs overlap, so the first holder boosts and the last one puts the
// threads back. The zero value is ready.
type SelfBoost struct {
	mu      sync.Mutex
	holders int
	restore func()
}

// Hold boosts the process's threads unless a holder already did, and returns the
// release. Best effort, as Boost.
func (b *SelfBoost) Hold() (release func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.holders == 0 {
		b.restore = boostSelf()
	}
	b.holders++
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			defer b.mu.Unlock()
			if b.holders--; b.holders == 0 {
				b.restore()
				b.restore = nil
			}
		})
	}
}
