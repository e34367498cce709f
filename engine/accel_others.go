//go:build !linux && !darwin

package engine

// detectAccel returns "tcg": no hardware accelerator is supported on this OS.
func detectAccel() Accel { return AccelTCG }
