//go:build !linux

package serve

import "github.com/forkvm/forkvm/api"

// connectedPorts is false where the daemon cannot see connections (no /proc/net/tcp):
// there only requests through the daemon keep a VM from being parked.
func connectedPorts([]api.PortForward) bool { return false }
