//go:build !linux

package vsockd

import (
	"context"
	"os"
	"syscall"
)

// execCgroups has no cgroups to give: cgroups are Linux's. afterGroupKill is never
// called (take gives no cgroup to kill).
type execCgroups struct{ afterGroupKill func(*proc) }

func (*execCgroups) take(*os.File, int) (*os.File, string) { return nil, "" }
func (*execCgroups) prepare(*os.File, int, int)            {}
func (*execCgroups) release(*os.File, string)              {}

// killNow and killFrozen have no cgroup to kill (take gives none).
func (*execCgroups) killNow(string) bool                      { return false }
func (*execCgroups) killFrozen(context.Context, string) error { return nil }
func waitCgroupEmpty(context.Context, string) error           { return nil }

// inCgroup does nothing: cgroups are Linux's.
func inCgroup(*syscall.SysProcAttr, *os.File) {}
