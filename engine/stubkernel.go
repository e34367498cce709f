package engine

import (
	"encoding/binary"
	"io"
	"os"
)

// writeStubKernel writes the first part of an x86 bzImage — its setup sectors plus one
// page — to dst and reports whether it did. Forks restore a guest that booted long ago,
// so they never read the kernel QEMU loads for fw_cfg; but -kernel also adds the
// linuxboot option ROM, a RAM block the migration stream expects. A stub with a valid
// boot header keeps the machine identical while sparing every fork's QEMU the ~12 MB
// heap copy of the real kernel.
// Non-bzImage kernels (arm64 Image) are not stubbed: forks use the real one.
func writeStubKernel(src, dst string) (bool, error) {
	f, err := os.Open(src)
	if err != nil {
		return false, err
	}
	defer f.Close()
	hdr := make([]byte, 0x210)
	if _, err := io.ReadFull(f, hdr); err != nil {
		return false, nil
	}
	if binary.LittleEndian.Uint32(hdr[0x202:]) != 0x53726448 { // "HdrS"
		return false, nil
	}
	sects := int64(hdr[0x1f1])
	if sects == 0 {
		sects = 4
	}
	n := (sects+1)*512 + 4096
	st, err := f.Stat()
	if err != nil || st.Size() < n {
		return false, err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return false, err
	}
	if _, err := io.Copy(out, io.NewSectionReader(f, 0, n)); err != nil {
		out.Close()
		os.Remove(dst)
		return false, err
	}
	return true, out.Close()
}
