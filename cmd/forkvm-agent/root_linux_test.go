//go:build linux

package main

import (
	"reflect"
	"testing"

	"github.com/forkvm/forkvm/guest"

	"github.com/forkvm/forkvm/internal/guestboot"
)

// The initramfs and CreateImage must agree on where the image's agent is.
func TestImageAgentPath(t *testing.T) {
	if imageAgentPath != guest.ImageAgentPath {
		t.Fatalf("agent execs %s, CreateImage installs %s", imageAgentPath, guest.ImageAgentPath)
	}
	// What guestboot.ImageKernelArgs says a root image boots with must parse here.
	a := parseBootArgs("console=ttyS0 " + guestboot.ImageKernelArgs(true))
	if a.root == nil || a.root.serial != guest.RootDiskSerial || a.data == nil || a.data.serial != guest.DataDiskSerial || len(a.problems) > 0 {
		t.Fatalf("%q parsed as root %v data %v %q", guestboot.ImageKernelArgs(true), a.root, a.data, a.problems)
	}
	if a := parseBootArgs(guestboot.ImageKernelArgs(false)); a.root == nil || a.data != nil {
		t.Fatalf("without data: root %v data %v", a.root, a.data)
	}
}

func TestParseBootArgs(t *testing.T) {
	vda, vdb := &diskSpec{dev: "vda"}, &diskSpec{dev: "vdb"}
	sroot, sdata := &diskSpec{serial: "forkvm-root"}, &diskSpec{serial: "forkvm-data"}
	for _, tc := range []struct {
		cmdline    string
		root, data *diskSpec
		problems   int
	}{
		{"console=ttyS0 quiet", nil, nil, 0},
		{"console=ttyS0 forkvm.disk=1", nil, vda, 0},
		{"forkvm.root=vda", vda, nil, 0},
		{"forkvm.root=/dev/vda forkvm.data=vdb", vda, vdb, 0},
		{"forkvm.root=serial:forkvm-root forkvm.data=serial:forkvm-data", sroot, sdata, 0},
		{"forkvm.root=vda forkvm.disk=1", vda, nil, 1},                 // legacy vda would be the root disk
		{"forkvm.root=vda forkvm.disk=1 forkvm.data=vdb", vda, vdb, 0}, // explicit wins
		{"forkvm.disk=1 forkvm.data=vdb", nil, vdb, 0},
		{"forkvm.root=vda forkvm.data=vda", vda, nil, 1},
		{"forkvm.root=../sda", nil, nil, 1},
		{"forkvm.root=serial:", nil, nil, 1},
		{"forkvm.root=serial:way-too-long-for-virtio-blk", nil, nil, 1},
		{"forkvm.root=VDA", nil, nil, 1},
		{"forkvm.disk=0", nil, nil, 0},
		{"forkvm.rootx=vda", nil, nil, 0},
	} {
		a := parseBootArgs(tc.cmdline)
		if !reflect.DeepEqual(a.root, tc.root) || !reflect.DeepEqual(a.data, tc.data) || len(a.problems) != tc.problems {
			t.Errorf("%q: root %v data %v problems %q", tc.cmdline, a.root, a.data, a.problems)
		}
	}
}
