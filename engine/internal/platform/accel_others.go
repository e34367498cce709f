//go:build !linux && !darwin

package platform

import "github.com/forkvm/forkvm/api"

// DetectAccel returns "tcg": no hardware accelerator is supported on this OS.
func DetectAccel() api.Accel { return api.AccelTCG }
