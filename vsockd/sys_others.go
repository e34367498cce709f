//go:build !linux

package vsockd

import "time"

// processStart approximates boot time on platforms without a boot clock.
var processStart = time.Now()

// applyHello has no guest-side effects outside Linux.
func applyHello(s *Server, h *helloWire) {}

func bootID() string { return "" }

func uptime() time.Duration { return time.Since(processStart) }
