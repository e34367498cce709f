//go:build darwin

package engine

// detectAccel returns "hvf": Hypervisor.framework is available on every Mac that runs
// a supported macOS.
func detectAccel() Accel { return "hvf" }
