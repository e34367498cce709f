//go:build darwin

package platform

import "github.com/forkvm/forkvm/api"

// DetectAccel returns "hvf": Hypervisor.framework is available on every Mac that runs
// a supported macOS.
func DetectAccel() api.Accel { return api.AccelHVF }
