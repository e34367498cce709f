//go:build !linux

package vsockd

import "time"

// fionread is FIONREAD on macOS and the BSDs (_IOR('f', 127, int)): the bytes a pipe
// or terminal holds.
const fionread = 0x4004667f

// processStart approximates boot time on platforms without a boot clock.
var processStart = time.Now()

// applyHello has no guest-side effects outside Linux.
func applyHello(s *Server, h *helloWire) {}

func bootID() string { return "" }

func uptime() time.Duration { return time.Since(processStart) }
