//go:build !unix

package vsockd

import (
	"context"
	"os"
	"sync/atomic"
	"time"
)

const sigKill = 9

// openNonblock is 0: open never waits here the way a unix FIFO's does.
const openNonblock = 0

type waitResult struct {
	code   int
	signal int
}

// proc is not available without unix process primitives.
type proc struct {
	pid    int
	status <-chan waitResult
	exited atomic.Bool
}

type output struct {
	t FrameType
	f *os.File
}

func (p *proc) outputs() []output                         { return nil }
func (p *proc) writeStdin([]byte) (int, error)            { return 0, ErrUnsupported }
func (p *proc) endStdin() error                           { return nil }
func (p *proc) markExited(time.Duration)                  {}
func (p *proc) signal(int)                                {}
func (p *proc) kill()                                     {}
func (p *proc) waitKilled(context.Context)                {}
func (p *proc) resize(rows, cols uint16) error            { return ErrUnsupported }
func (p *proc) closeFiles()                               {}
func (p *proc) releaseCgroup()                            {}
func startProcess(*execStartWire, *Server) (*proc, error) { return nil, ErrUnsupported }

type execError struct {
	code string
	msg  string
}

func (e *execError) Error() string { return e.msg }

// readReady is a read whose deadline passed: without unix, nothing more is read.
func readReady(*os.File, []byte) (int, error) { return 0, os.ErrDeadlineExceeded }

// outputLeft is what an output holds after the exit: without unix, nothing known.
func outputLeft(*os.File) (int, bool) { return 0, false }
