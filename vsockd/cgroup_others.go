//go:build !linux

package vsockd

import (
	"os"
	"syscall"
)

// execCgroups has no cgroups to give: cgroups are Linux's.
type execCgroups struct{}

func (*execCgroups) take(*os.File, int) (*os.File, string) { return nil, "" }
func (*execCgroups) prepare(*os.File, int, int)            {}
func (*execCgroups) release(*os.File, string)              {}

// inCgroup does nothing: cgroups are Linux's.
func inCgroup(*syscall.SysProcAttr, *os.File) {}
